"""Default export: the consolidated model as a Hugging Face folder of safetensors shards (runs last)."""

from pathlib import Path

from hfsdp import hookimpl

ALWAYS_ON = True


@hookimpl(trylast=True)
def hfsdp_export(state_dict, model_config, tokenizer, out_dir, generation_config):
    from hfsdp.components.export import write_hf_folder  # imports torch: not at module level (validate, plugins)

    write_hf_folder(state_dict, model_config, tokenizer, Path(out_dir), generation_config=generation_config)
    return True
