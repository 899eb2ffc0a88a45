"""The model card (``README.md``) of an export: what was trained from what, on what, how, and what ``hfsdp eval``
measured, in the Hugging Face Hub's format (``huggingface_hub.ModelCard``: YAML metadata with ``base_model``,
``library_name``, ``tags`` and the evaluations' ``model-index``, then the text).

:func:`write_card` writes it with the export (:func:`hfsdp.export.pipeline.write_export`, every export); :func:`add_evals`
puts ``hfsdp eval``'s results into an existing card (metadata and the text between the evaluation markers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsdp import __version__
from hfsdp.config.files import PRESET_DIR

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig

CARD_NAME = "README.md"
EVAL_START, EVAL_END = "<!-- hfsdp eval -->", "<!-- /hfsdp eval -->"
NOT_EVALUATED = "Not evaluated with lm-evaluation-harness yet: `hfsdp eval THIS_FOLDER --tasks TASKS`."
NOT_EVALUATED_ADAPTERS = ("Not evaluated with lm-evaluation-harness yet: export the checkpoint with `--merge-lora`, "
                          "then `hfsdp eval THAT_FOLDER --tasks TASKS`.")
# The objective of a run, by the plugin that replaces next-token cross-entropy (none: supervised fine-tuning)
OBJECTIVES = {"dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "kto": "KTO", "reward_model": "reward model",
              "distill": "distillation", "distill_online": "on-policy distillation", "grpo": "GRPO", "rloo": "RLOO"}


@dataclass(frozen=True)
class Trained:
    """How far the exported weights were trained."""

    step: int | None
    ranks: int
    tokens_seen: int | None = None


def _objective(config: "HfsdpConfig") -> str:
    named = [OBJECTIVES[p] for p in config.plugins if p in OBJECTIVES]
    return named[0] if named else "supervised fine-tuning (next-token cross-entropy)"


def _data_path(path: str) -> str:
    """A data path as the card names it: the presets' bundled data by its file, not by where pip installed it."""
    if Path(path).expanduser().resolve().parent == (PRESET_DIR / "data").resolve():
        return f"`{Path(path).name}` (bundled with hfsdp)"
    return f"`{path}`"


def _data(config: "HfsdpConfig") -> str:
    data = config.data
    if data.datasets:
        parts = [_data_path(s.path) + (f" (weight {s.weight:g})" if s.weight is not None else "")
                 for s in data.datasets]
        return f"{', '.join(parts)} ({data.format})"
    return f"{_data_path(data.path)} ({data.format})"


def _adapters(config: "HfsdpConfig", folder: Path) -> str | None:
    lora = config.section("lora")
    if lora is None:
        return None
    how = "trained adapters only (this folder)" if (folder / "adapter_config.json").is_file() else "merged into the weights"
    return f"LoRA r {lora.r}, alpha {lora.alpha:g}; {how}"


def _base_model(name: str) -> str | None:
    """A hub id the Hub can link (``owner/name``), not a local folder or a built-in name."""
    parts = name.split("/")
    return name if len(parts) == 2 and all(parts) and not Path(name).expanduser().exists() else None


def _rows(config: "HfsdpConfig", trained: Trained, folder: Path) -> list[tuple[str, str]]:
    train, fsdp = config.train, config.fsdp
    steps = f"{trained.step}" if trained.step is not None else "unknown"
    if train.max_steps:
        steps += f" of {train.max_steps}"
    rows = [("base model", f"`{config.model.name_or_path}`"), ("objective", _objective(config)),
            ("data", _data(config)), ("optimizer steps", steps)]
    if trained.tokens_seen:
        rows.append(("tokens trained on", f"{trained.tokens_seen:,}"))
    if adapters := _adapters(config, folder):
        rows.append(("adapters", adapters))
    precision = fsdp.mixed_precision if isinstance(fsdp.mixed_precision, str) else "custom"
    rows += [("batch", f"{train.per_device_batch_size} a rank x {train.gradient_accumulation_steps} accumulation"),
             ("learning rate", f"{train.learning_rate:g} ({train.lr_scheduler}, {train.warmup_steps} warm-up "
                               f"step{'' if train.warmup_steps == 1 else 's'}), {train.optimizer}"),
             ("sequence length", f"{config.data.max_seq_len} tokens"),
             ("processes", f"{trained.ranks}, FSDP{fsdp.version} {fsdp.sharding_strategy}" + "".join(
                 f", {what} {n}" for what, n in (("tensor parallel", config.parallel.tp_size),
                                                 ("sequence parallel", config.parallel.sp_size)) if n > 1)
              if trained.ranks > 1 else "1"),
             ("mixed precision", precision),
             ("seed", str(train.seed)), ("written by", f"hfsdp {__version__}")]
    return rows


def write_card(folder: Path, config: "HfsdpConfig", trained: Trained, destination: Path) -> Path:
    """The model card of the export staged in ``folder`` (to become ``destination``), from the run's config and how
    far it trained; the GGUF file and Modelfile in the folder, if any, are named in its use section."""
    from huggingface_hub import ModelCard, ModelCardData

    name = destination.name if destination.name != "final" else destination.resolve().parent.name
    adapters = (folder / "adapter_config.json").is_file()
    model_config = folder / "config.json"
    architectures = (json.loads(model_config.read_text()).get("architectures") or []) if model_config.is_file() else []
    scorer = any(a.endswith("ForSequenceClassification") for a in architectures)  # a reward model
    auto = "AutoModelForSequenceClassification" if scorer else "AutoModelForCausalLM"
    tags = ["hfsdp", "fsdp", *(["lora"] if config.section("lora") is not None else []),
            *([p for p in config.plugins if p in OBJECTIVES])]
    data = ModelCardData(model_name=name, base_model=_base_model(config.model.name_or_path),
                         library_name="peft" if adapters else "transformers", tags=tags,
                         pipeline_tag="text-classification" if scorer else "text-generation")
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in _rows(config, trained, folder))])
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    use = (f"```python\nfrom transformers import {auto}, AutoTokenizer\n\n"
           f"model = {auto}.from_pretrained(\"PATH\")\n"
           "tokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n```" if not adapters else
           "```python\nfrom peft import AutoPeftModelForCausalLM\n\n"
           "model = AutoPeftModelForCausalLM.from_pretrained(\"PATH\")\n```")
    if ggufs:
        use += (f"\n\nllama.cpp: `llama-cli -m {ggufs[0]}`" +
                ("; Ollama: `ollama create NAME -f Modelfile`" if (folder / "Modelfile").is_file() else ""))
    text = (f"---\n{data.to_yaml()}\n---\n\n# {name}\n\n`{config.model.name_or_path}` fine-tuned with hfsdp "
            f"(PyTorch FSDP through Hugging Face Accelerate).\n\n## Training\n\n{table}\n\n## Evaluation\n\n"
            f"{EVAL_START}\n{NOT_EVALUATED_ADAPTERS if adapters else NOT_EVALUATED}\n{EVAL_END}\n\n## Use\n\n{use}\n")
    path = folder / CARD_NAME
    ModelCard(text).save(path)
    return path


def add_evals(folder: Path, entry: dict[str, Any]) -> Path | None:
    """``hfsdp eval``'s ``entry`` (tasks, scores) into ``folder``'s card, if it has one hfsdp wrote: the metadata's
    ``model-index`` and the table between the evaluation markers. Returns the card, or None (no hfsdp card)."""
    from huggingface_hub import EvalResult, ModelCard

    path = folder / CARD_NAME
    if not path.is_file() or EVAL_START not in (text := path.read_text()) or EVAL_END not in text:
        return None
    card = ModelCard(text)
    results = []
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, values in sorted(entry["scores"].items()):
        for key, value in sorted(values.items()):
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr"):
                continue
            stderr = values.get(f"{metric}_stderr,{filt}")
            results.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                      metric_type=metric, metric_value=float(value)))
            lines.append(f"| {task} | {metric} | {value:.4f} | "
                         + (f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "-") + " |")
    shots = ", ".join(f"{t}: {n}" for t, n in sorted(entry.get("n_shot", {}).items()))
    where = "one process" if entry["ranks"] == 1 else f"{entry['ranks']} ranks"
    lines.append(f"\nlm-evaluation-harness {entry['lm_eval_version']} through `hfsdp eval` on {where}; examples in "
                 f"each prompt: {shots or 'as each task sets'}.")
    card.data.eval_results = results
    if not card.data.model_name:
        card.data.model_name = folder.name
    before, rest = card.text.split(EVAL_START, 1)
    card.text = before + EVAL_START + "\n" + "\n".join(lines) + "\n" + EVAL_END + rest.split(EVAL_END, 1)[1]
    card.save(path)
    return path

