"""Default export: the consolidated model as a Hugging Face folder of safetensors shards (runs last)."""

from pathlib import Path

from hfsdp import hookimpl

ALWAYS_ON = True


@hookimpl(trylast=True)
def hfsdp_export(state_dict, out_dir, model_files, max_shard_bytes):
    from hfsdp.export.hf_folder import write_model_folder  # imports torch: not at module level (validate, plugins)

    write_model_folder(state_dict, model_files, Path(out_dir), max_shard_bytes=max_shard_bytes)
    return True
