"""Plugin ``gguf_export``: with every export (the end of training, ``hfsdp export``), also write the model as a GGUF
file for llama.cpp, Ollama and LM Studio, and an Ollama ``Modelfile`` beside it. Enable with ``plugins:
[gguf_export]``, or ``hfsdp export CHECKPOINT OUT --format gguf [--quant q4_1]``.

Config section ``gguf_export:`` (all optional): :class:`GgufExportSection` (``hfsdp config-reference gguf_export``).

The GGUF is written from the exported Hugging Face folder, one tensor at a time (:mod:`hfsdp.export.gguf_file`), as
``model-<quant>.gguf``; LoRA runs export merged weights for it (``lora.merge: true``, or ``--format gguf``, which
merges). What cannot be written (another architecture, a scaled rotary embedding, a tokenizer whose llama.cpp
pre-tokenizer is unknown) is refused by this plugin's rules (``hfsdp_rules``, the ``model`` phase): before any weight
loads, and before ``hfsdp export`` writes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.config.schema import Section
from hfsdp.errors import UserError
from hfsdp.export.gguf_file import QUANTS, problems
from hfsdp.rules.table import Rule

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
def hfsdp_rules():
    return [Rule("config", ("gguf_export", "lora.merge", "plugins"), config_problems),
            Rule("model", ("gguf_export", "model.name_or_path"), model_problems)]


def config_problems(config, facts) -> list[tuple[str, str]]:
    found = []
    lora = config.section("lora")
    if lora is not None and not lora.merge:
        found.append(("gguf_export", "a GGUF file holds full weights, and this run exports LoRA adapters: "
                                     "set lora.merge: true (the export then merges them), or remove "
                                     "gguf_export and run `hfsdp export CHECKPOINT OUT --format gguf` "
                                     "later, which merges"))
    if "reward_model" in config.plugins:
        found.append(("gguf_export", "a reward model is exported as a sequence classifier "
                                     "(LlamaForSequenceClassification), which hfsdp does not write as GGUF: "
                                     "remove gguf_export from plugins (or --format gguf from hfsdp "
                                     "export)"))
    return found


def model_problems(config, facts) -> list[tuple[str, str]]:
    """The architecture, its rotary embedding and the tokenizer (where the facts have it: ``hfsdp plan`` has none)
    the GGUF writer cannot write, before any weight loads."""
    import json

    tokenizer = facts.tokenizer
    section: GgufExportSection = config.section("gguf_export")
    found = problems(facts.model_config.to_dict(),
                     json.loads(tokenizer.backend_tokenizer.to_str()) if tokenizer is not None else None,
                     section.pre_tokenizer)
    return [("gguf_export", f"{config.model.name_or_path}: {'; '.join(found)} (refused before any weight loads; "
                            "without gguf_export, or --format gguf, the run or export goes on)")] if found else []


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
