"""One export pipeline: the trained model at the end of training (``train.output_dir/final``, by
:func:`hfsdp.run.summary.export_model`) and a saved checkpoint (:func:`export_checkpoint`, ``hfsdp export``) become
a Hugging Face folder the same way (:func:`write_export`): the weights (a 4-bit base dequantized for QLoRA), staged
next to their final place, through the ``hfsdp_export`` hook, so plugins (e.g. LoRA) export checkpoints the way they
export final models.

``hfsdp export`` runs in one process without a process group: sharded (DCP) checkpoints are read and written one
tensor at a time, so peak memory stays near the largest tensor whatever the model size, and the built-in export
imports no transformers (it copies the checkpoint's config and tokenizer files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, TYPE_CHECKING

from hfsdp.checkpoint.safe_load import CheckpointWeights
from hfsdp.export.card import Trained, write_card
from hfsdp.errors import ConfigError, UserError
from hfsdp.export.staging import check_export_target, staged_export
from hfsdp.hooks.host import Lazy, PluginHost
from hfsdp.model import quantized
from hfsdp.model.metadata import ModelFiles, model_metadata
from hfsdp.config.files import load_config
from hfsdp.layout.degrees import World
from hfsdp.rules import quantization
from hfsdp.rules.table import Facts, enforce
from hfsdp.disk.checkpoints import CONFIG_NAME, read_record


if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


def write_export(host: PluginHost, out_dir: Path, weights: Mapping[str, Any], *, config: "HfsdpConfig",
                 model_config, tokenizer, generation_config, model_files: ModelFiles, overwrite: bool, trained: Trained,
                 source: Path | None = None, max_shard_bytes: int | None = None, merge_adapters: bool = False) -> None:
    """``weights`` into ``out_dir`` through the ``hfsdp_export`` hook, with its model card (``README.md``,
    :mod:`hfsdp.export.card`), written into a temporary folder beside it and renamed into place when complete
    (:func:`hfsdp.export.staging.staged_export`)."""
    with staged_export(out_dir, overwrite=overwrite, source=source) as tmp:
        host.export(state_dict=weights, model_config=model_config, tokenizer=tokenizer, out_dir=tmp,
                    destination=out_dir, generation_config=generation_config, config=config, model_files=model_files,
                    max_shard_bytes=max_shard_bytes, merge_adapters=merge_adapters)
        write_card(tmp, config, trained, out_dir)


def merges(config: "HfsdpConfig", merge_adapters: bool) -> bool:
    """The export merges adapters into the base: asked for (``--merge-lora``), or by a plugin section's own
    ``merge: true`` (the ``hfsdp_export`` convention)."""
    return merge_adapters or any(getattr(section, "merge", False) is True for section in config.plugin_config.values())


def gguf_overrides(checkpoint_dir: Path, quant: str | None) -> list[str]:
    """The ``--set`` overrides that make an export of ``checkpoint_dir`` also write GGUF (``hfsdp export --format
    gguf``): the ``gguf_export`` plugin with ``quant`` (None: its default), adapters merged. A model the GGUF writer
    cannot write is refused by the plugin's rules when the export checks its config (:func:`export_checkpoint`)."""
    import json

    import yaml

    read_record(checkpoint_dir)
    raw = yaml.safe_load((checkpoint_dir / CONFIG_NAME).read_text()) or {}
    plugins = [p for p in raw.get("plugins") or [] if p != "gguf_export"] + ["gguf_export"]
    return [f"plugins={json.dumps(plugins)}", *([f"gguf_export.quant={quant}"] if quant else []),
            *(["lora.merge=true"] if "lora" in plugins else [])]


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, overrides: list[str],
                      max_shard_bytes: int | None = None, overwrite: bool = False, cache_dir: Path | None = None,
                      merge_adapters: bool = False) -> Path:
    """Export ``checkpoint_dir`` into ``out_dir`` through the ``hfsdp_export`` hook. ``out_dir`` must be new, empty,
    or (with ``overwrite``) an earlier hfsdp export; it is written next to its final place and renamed when complete.
    ``cache_dir``: where built-in models are (QLoRA's merged export loads the 4-bit base again from there)."""
    record = read_record(checkpoint_dir)  # refuses a folder whose save never completed
    check_export_target(out_dir, overwrite=overwrite, source=checkpoint_dir)  # before anything is loaded
    config, host = load_config(str(checkpoint_dir / CONFIG_NAME), overrides)
    model_dir = checkpoint_dir / "model"
    quant = quantization.settings(config)
    if quant is not None and merges(config, merge_adapters):
        problem = quantized.base_not_in_cache(config.model.name_or_path)
        if problem:
            raise ConfigError([("model.name_or_path", problem)], source=str(checkpoint_dir))

    def load(kind: str):  # transformers only if a rule or plugin asks (the built-in export copies the files as they are)
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            return getattr(transformers, kind).from_pretrained(str(model_dir))
        except (OSError, ValueError) as err:
            raise UserError(f"{model_dir}: cannot read the checkpoint's model files ({kind}): {err}") from None

    model_config, tokenizer = Lazy(lambda: load("AutoConfig")), Lazy(lambda: load("AutoTokenizer"))
    # the config's rules, and the model's on one process (a plugin's too: what gguf_export cannot write)
    enforce(config, Facts(host, World(rank=0, size=1, local_size=1, on_cpu=True).with_dims(config), model_config,
                          tokenizer), ("config", "model"), source=str(checkpoint_dir / CONFIG_NAME))

    def base_layers() -> dict:  # the 4-bit base loaded again, quantized as the run loaded it
        from hfsdp.model import loading

        path = loading.resolve_model_path(config.model.name_or_path, cache_dir)
        return dict(quantized.quantized_linears(loading.load_model(path, config.model, quant=quant)))

    weights = quantized.exported_weights(CheckpointWeights(checkpoint_dir), config, base_layers,
                                            check_bytes=True)
    generation_config = Lazy(lambda: model_metadata(model_dir)["generation_config"])
    write_export(host, out_dir, weights, config=config, model_config=model_config, tokenizer=tokenizer,
                 generation_config=generation_config, model_files=ModelFiles.in_folder(model_dir), overwrite=overwrite,
                 source=checkpoint_dir, max_shard_bytes=max_shard_bytes, merge_adapters=merge_adapters,
                 trained=Trained(record.get("step"), int(record.get("world_size") or 1)))
    return out_dir
