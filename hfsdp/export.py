"""``hfsdp export``: a saved checkpoint (FULL or SHARDED, any world size) → a Hugging Face safetensors folder.

Runs in one process without a process group: sharded (DCP) checkpoints are read tensor by tensor, so peak memory
stays near one shard of output rather than the whole model. The export goes through the same ``hfsdp_export`` hook
as the end of training, so plugins (e.g. LoRA) export checkpoints the way they export final models.
"""

from __future__ import annotations

from pathlib import Path

from hfsdp.components import checkpoint
from hfsdp.components.export import max_shard_size, model_metadata
from hfsdp.config import load_config
from hfsdp.errors import UserError


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, overrides: list[str],
                      max_shard_bytes: int | None = None) -> Path:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    checkpoint.read_record(checkpoint_dir)  # refuses a folder whose save never completed
    config, host = load_config(str(checkpoint_dir / checkpoint.CONFIG_NAME), overrides)
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError("export: OUT_DIR must differ from the checkpoint folder")
    model_dir = checkpoint_dir / "model"
    model_config = AutoConfig.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    weights = checkpoint.CheckpointWeights(checkpoint_dir)
    with max_shard_size(max_shard_bytes):
        host.first("hfsdp_export", state_dict=weights, model_config=model_config, tokenizer=tokenizer,
                   out_dir=out_dir, generation_config=model_metadata(model_dir)["generation_config"], config=config)
    return out_dir
