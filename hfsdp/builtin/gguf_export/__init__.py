"""Plugin ``gguf_export``: with every export (the end of training, ``hfsdp export``), also write the model as a GGUF
file for llama.cpp, Ollama and LM Studio, and an Ollama ``Modelfile`` beside it. Enable with ``plugins:
[gguf_export]``, or ``hfsdp export CHECKPOINT OUT --format gguf [--quant q4_1]``.

Config section ``gguf_export:`` (all optional): :class:`GgufExportSection` (``hfsdp config-reference gguf_export``).

The GGUF is written from the exported Hugging Face folder, one tensor at a time (:mod:`hfsdp.export.gguf_file`), as
``model-<quant>.gguf``; LoRA runs export merged weights for it (``lora.merge: true``, or ``--format gguf``, which
merges). What cannot be written is refused before training (another architecture, a scaled rotary embedding: before
any weight loads; a tokenizer whose llama.cpp pre-tokenizer is unknown: before the first step), and before ``hfsdp
export`` writes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.config.schema import Section
from hfsdp.errors import ConfigError, UserError
from hfsdp.export.gguf_file import QUANTS, problems

GGUF_NAME = "model-{quant}.gguf"


class GgufExportSection(Section):
    quant: Literal[QUANTS] = Field("q8_0", description="tensor type of the matrices: f16, bf16, q8_0, q4_0 or q4_1 "
                                                       "(norms stay float32; with a 4-bit type the embedding and "
                                                       "output head are q8_0)")
    pre_tokenizer: str | None = Field(None, description="llama.cpp's pre-tokenizer name for the model's tokenizer "
                                                        "(e.g. llama-bpe, qwen2); default: recognised for SmolLM2's")
    modelfile: bool = Field(True, description="also write an Ollama Modelfile (FROM the GGUF, its stop tokens)")


@hookimpl
def hfsdp_config_section():
    return "gguf_export", GgufExportSection


@hookimpl
def hfsdp_validate_config(config):
    problems_found = []
    lora = config.section("lora")
    if lora is not None and not lora.merge:
        problems_found.append(("gguf_export", "a GGUF file holds full weights, and this run exports LoRA adapters: "
                                              "set lora.merge: true (the export then merges them), or remove "
                                              "gguf_export and run `hfsdp export CHECKPOINT OUT --format gguf` "
                                              "later, which merges"))
    if "reward_model" in config.plugins:
        problems_found.append(("gguf_export", "a reward model is exported as a sequence classifier "
                                              "(LlamaForSequenceClassification), which hfsdp does not write as GGUF: "
                                              "remove gguf_export from plugins (or --format gguf from hfsdp "
                                              "export)"))
    return problems_found


def _refused(config, found: list[str], when: str) -> str:
    return (f"{config.model.name_or_path}: {'; '.join(found)} (refused {when}; remove gguf_export from plugins to "
            "train without it)")


@hookimpl
def hfsdp_before_model_load(config, model_config):
    if found := problems(model_config.to_dict(), None):  # (hfsdp plan: the row's reason)
        raise ConfigError([("gguf_export", _refused(config, found, "before any weight loads"))])


@hookimpl
def hfsdp_on_train_start(run):
    import json

    section: GgufExportSection = run.config.section("gguf_export")
    if found := problems(run.model_config.to_dict(), json.loads(run.tokenizer.backend_tokenizer.to_str()),
                         section.pre_tokenizer):
        raise UserError(f"gguf_export: {_refused(run.config, found, 'before the first step')}")


@hookimpl
def hfsdp_on_export(out_dir, destination, config, written_by, model_config, tokenizer):
    from hfsdp.export.gguf_file import write_gguf

    section: GgufExportSection = config.section("gguf_export")
    out_dir = Path(out_dir)
    if not any(out_dir.glob("*.safetensors")) or (out_dir / "adapter_config.json").is_file():
        raise UserError(f"gguf_export: {destination} holds LoRA adapters, not full weights: export merged weights "
                        "(lora.merge: true, or hfsdp export --format gguf)")
    gguf = out_dir / GGUF_NAME.format(quant=section.quant)  # (write_gguf refuses what it cannot write, first)
    write_gguf(out_dir, gguf, section.quant, name=Path(config.model.name_or_path).name, pre_tokenizer=section.pre_tokenizer)
    if section.modelfile:
        write_modelfile(out_dir, gguf.name)


def write_modelfile(folder: Path, gguf_name: str) -> Path:
    """An Ollama Modelfile beside the GGUF: ``FROM`` it, and a ``stop`` parameter for each end-of-turn token of the
    generation config (Ollama reads the chat template from the GGUF)."""
    import json

    stops = []
    generation = folder / "generation_config.json"
    tokens = json.loads((folder / "tokenizer.json").read_text())
    by_id = {t["id"]: t["content"] for t in tokens.get("added_tokens", [])}
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stops = [by_id[i] for i in (eos if isinstance(eos, list) else [eos]) if i in by_id]
    lines = [f"FROM ./{gguf_name}", *(f'PARAMETER stop "{s}"' for s in stops)]
    path = folder / "Modelfile"
    path.write_text("\n".join(lines) + "\n")
    return path
