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

import json
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Mapping, TYPE_CHECKING

from hfsdp.checkpoint.safe_load import CheckpointWeights
from hfsdp.disk.durable import EXPORT_RECORD, RECORD
from hfsdp.disk.lock import put_back_abandoned
from hfsdp.export.card import Trained, write_card
from hfsdp.errors import ConfigError, UserError
from hfsdp.export.staging import check_export_target, staged_export
from hfsdp.hooks.host import Lazy, PluginHost
from hfsdp.model import quantized
from hfsdp.model.metadata import ModelFiles, model_metadata
from hfsdp.config.files import load_config
from hfsdp.disk.checkpoints import CONFIG_NAME, latest, read_record
from hfsdp.layout.degrees import World
from hfsdp.rules import quantization
from hfsdp.rules.table import Facts, enforce


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


def gguf_overrides(source: "ExportSource", quant: str | None) -> list[str]:
    """The ``--set`` overrides that make an export of ``source`` also write GGUF (``hfsdp export --format gguf``):
    the ``gguf_export`` plugin with ``quant`` (None: its default), adapters merged. A model the GGUF writer cannot
    write is refused by the plugin's rules when the export checks the config and the model, before anything is
    written (:func:`export_checkpoint`)."""
    import yaml

    raw = yaml.safe_load(source.config.read_text()) or {}
    plugins = [p for p in raw.get("plugins") or [] if p != "gguf_export"] + ["gguf_export"]
    return [f"plugins={json.dumps(plugins)}", *([f"gguf_export.quant={quant}"] if quant else []),
            *(["lora.merge=true"] if "lora" in plugins else [])]


# What a model folder holds besides its weights (a run's final/ also holds its card, record, GGUF...): the files an
# export of it copies as they are
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
               "chat_template.*", "vocab.*", "merges.txt")
RUN_CONFIG = "config.yaml"  # in a run folder: the run's resolved config (hfsdp.run.loop)


@dataclass(frozen=True)
class ExportSource:
    """What ``hfsdp export`` reads: a checkpoint, or a finished run's ``final/``: the folder of the weights, the
    folder of the model's other files (config.json, tokenizer), the run's config, and how far it trained."""

    weights: Path
    model_dir: Path
    config: Path
    trained: Trained

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> "ExportSource":
        record = read_record(checkpoint)  # refuses a folder whose save never completed
        return cls(checkpoint, checkpoint / "model", checkpoint / CONFIG_NAME,
                   Trained(record.get("step"), int(record.get("world_size") or 1)))

    def model_files(self) -> ModelFiles:
        if self.model_dir != self.weights:
            return ModelFiles.in_folder(self.model_dir)
        return ModelFiles.in_folder(self.model_dir, keep=lambda name: any(fnmatch(name, p) for p in MODEL_FILES))


def export_source(path: Path) -> ExportSource:
    """What ``hfsdp export PATH`` exports, whichever the user holds: a checkpoint (``RUN/checkpoints/step-N``), a
    finished run's ``final/``, or a run folder (its ``final/``; without one, or where it holds LoRA adapters, the
    checkpoint of the run's last step). A run killed before its first step (kill -9) left the run it replaced set
    aside: put back first (:func:`hfsdp.disk.lock.put_back_abandoned`)."""
    path = Path(path)
    for folder in (path, path.parent, path.parent.parent):  # the run folder of a run, its final/, a checkpoint
        put_back_abandoned(folder)
    if (path / RECORD).is_file() or not path.exists():
        return ExportSource.of_checkpoint(path)
    run = path.parent if path.name == "final" and (path.parent / RUN_CONFIG).is_file() else path
    if not (run / RUN_CONFIG).is_file() or not ((run / "final").is_dir() or (run / "checkpoints").is_dir()):
        return ExportSource.of_checkpoint(path)  # not a run's: the record's refusal says what it is
    final, newest = run / "final", latest(run / "checkpoints")
    summary = _summary(run)
    steps = summary.get("steps")
    if (final / EXPORT_RECORD).is_file() and not (final / "adapter_config.json").is_file():
        return ExportSource(final, final, run / RUN_CONFIG, Trained(steps, int(summary.get("startup", {}).get(
            "world_size") or 1), summary.get("tokens_seen")))
    last = newest is not None and (steps is None or int(newest.name.rpartition("-")[2]) == steps)
    if (final / EXPORT_RECORD).is_file():  # LoRA adapters: merged (and written as GGUF) from the run's checkpoint
        if last:
            return ExportSource.of_checkpoint(newest)
        raise UserError(f"export: {final} holds LoRA adapters only, and no checkpoint of {run} holds the run's last "
                        f"step ({steps}), from which export merges them into the base (the run saved none: "
                        "train.save_every). Use the adapters in final/ as they are (peft), or train again with "
                        "train.save_every set")
    if newest is not None:
        return ExportSource.of_checkpoint(newest)
    raise UserError(f"export: {run} is a run folder with neither a finished model (final/, written at the run's "
                    "end) nor a complete checkpoint: the run was not finished. Train it again (with --overwrite), "
                    "or --resume it if it saved a checkpoint elsewhere")


def _summary(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def export_checkpoint(source: ExportSource, out_dir: Path, overrides: list[str],
                      max_shard_bytes: int | None = None, overwrite: bool = False, cache_dir: Path | None = None,
                      merge_adapters: bool = False) -> Path:
    """Export ``source`` (:func:`export_source`: a checkpoint or a run's final/) into ``out_dir`` through the
    ``hfsdp_export`` hook. ``out_dir`` must be new, empty, or (with ``overwrite``) an earlier hfsdp export; it is
    written next to its final place and renamed when complete. ``cache_dir``: where built-in models are (QLoRA's
    merged export loads the 4-bit base again from there)."""
    check_export_target(out_dir, overwrite=overwrite, source=source.weights)  # before anything is loaded
    config, host = load_config(str(source.config), overrides)
    model_dir = source.model_dir
    quant = quantization.settings(config)
    if quant is not None and merges(config, merge_adapters):
        problem = quantized.base_not_in_cache(config.model.name_or_path)
        if problem:
            raise ConfigError([("model.name_or_path", problem)], source=str(source.weights))

    def load(kind: str):  # transformers only if a rule or plugin asks (the built-in export copies the files as they are)
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            return getattr(transformers, kind).from_pretrained(str(model_dir))
        except (OSError, ValueError) as err:
            raise UserError(f"{model_dir}: cannot read the model's files ({kind}): {err}") from None

    model_config, tokenizer = Lazy(lambda: load("AutoConfig")), Lazy(lambda: load("AutoTokenizer"))
    # the config's rules, and the model's on one process (a plugin's too: what gguf_export cannot write)
    enforce(config, Facts(host, World(rank=0, size=1, local_size=1, on_cpu=True).with_dims(config), model_config,
                          tokenizer), ("config", "model"), source=str(source.config))

    def base_layers() -> dict:  # the 4-bit base loaded again, quantized as the run loaded it
        from hfsdp.model import loading

        path = loading.resolve_model_path(config.model.name_or_path, cache_dir)
        return dict(quantized.quantized_linears(loading.load_model(path, config.model, quant=quant)))

    weights = quantized.exported_weights(CheckpointWeights(source.weights), config, base_layers, check_bytes=True)
    generation_config = Lazy(lambda: model_metadata(model_dir)["generation_config"])
    write_export(host, out_dir, weights, config=config, model_config=model_config, tokenizer=tokenizer,
                 generation_config=generation_config, model_files=source.model_files(), overwrite=overwrite,
                 source=source.weights, max_shard_bytes=max_shard_bytes, merge_adapters=merge_adapters,
                 trained=source.trained)
    return out_dir
