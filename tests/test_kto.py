"""KTO (plugin ``kto``, :mod:`hfsdp.builtin.kto`) and the ``unpaired`` format: the loss and every metric TRL 1.16's
``KTOTrainer._compute_loss`` logs that hfsdp logs equal TRL's on the same rows and model (TRL's own method and
collator, its KL rows built by TRL's rotation, called on the shrunk SmolLM2 with reference log-probs of a second
model, as TRL's precomputed route reads them); the format's refusals, each naming the row. Through the real CLI:
tests/test_combinations.py (the smoke and resume matrices, 2 ranks computing what one process computes). The 6-step
training comparison against TRL is ``benchmarks/trl_preference.py kto`` (not in CI)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

ROWS = [("Q: 2+2?", " 4", True), ("Q: name a colour.", " Blue, the colour of the sky.", True),
        ("Say hi.", " Good morning to you, dear friend!", False), ("Q: 3+3?", " seven", False)]


@pytest.fixture(scope="module")
def models_and_rows(tiny_model_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.kto.loss import with_kl_rows
    from hfsdp.builtin.unpaired import tokenize_row
    from hfsdp.config.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="unpaired", path="unused", max_seq_len=64)
    rows = Dataset.from_list([tokenize_row(*r, tokenizer, cfg) for r in ROWS])
    rows = list(with_kl_rows(rows, len(ROWS), cfg.max_seq_len))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # another model as the reference, so that the log-ratios are not zero
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, reference, rows, tokenizer.pad_token_id


def trl_examples(rows) -> list[dict]:
    """The rows as TRL's tokenization gives them (prompt and completion ids), with TRL's own KL rotation."""
    examples = []
    for r in rows:
        start = next(i for i, t in enumerate(r["labels"]) if t != -100)
        examples.append({"prompt_ids": r["input_ids"][:start], "completion_ids": r["input_ids"][start:],
                         "label": r["label"]})
    completions = [e["completion_ids"] for e in examples]
    for e, kl in zip(examples, [completions[-1]] + completions[:-1]):  # TRL's add_kl_completion_ids
        e["KL_completion_ids"] = kl
    return examples


def trl_loss(model, reference, rows, pad_id: int, beta: float, weights: tuple[float, float]):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits"))
    add_fused_lm_head(reference)
    collate = DataCollatorForUnpairedPreference(pad_token_id=pad_id)
    examples = trl_examples(rows)
    trainer = SimpleNamespace(model=model, ref_model=reference, calculate_KL=True, precompute_ref_logps=False,
                              loss_type="kto", beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1],
                              aux_loss_enabled=False, _tp_size=1, _total_train_tokens=0,
                              args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                              accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda t: t,
                                                          unwrap_model=lambda m: m, autocast=contextlib.nullcontext),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    trainer._compute_kl_logps = KTOTrainer._compute_kl_logps.__get__(trainer)
    ref_logps, ref_kl = KTOTrainer.compute_ref_log_probs(trainer, reference, collate(examples))
    with torch.no_grad():
        loss = KTOTrainer._compute_loss(trainer, model, collate(examples), False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}, ref_logps, ref_kl


@pytest.mark.parametrize("beta,weights,swap", [(0.1, (1.0, 1.0), False), (2.0, (1.0, 1.33), True)])
def test_kto_loss_and_metrics_equal_trls_kto_trainer(models_and_rows, beta, weights, swap):
    """Both sides of the clamp: a KL estimate above 0, and one below (clamped to 0; the two models swapped)."""
    from hfsdp.builtin.kto import KtoSection
    from hfsdp.builtin.kto.loss import KTO
    from hfsdp.config.schema import DataConfig

    model, reference, rows, pad_id = models_and_rows
    if swap:
        model, reference = reference, model
    want_loss, want, ref_logps, ref_kl = trl_loss(model, reference, rows, pad_id, beta, weights)
    assert (want["kl"] == 0) != swap  # swapped: an estimate above 0; else below 0, clamped
    # hfsdp's precomputed route: the reference's log-probs as columns (TRL's ref_logps and ref_KL_logps)
    ours_rows = [r | {"ref_logps": float(a), "ref_KL_logps": float(b)} for r, a, b in zip(rows, ref_logps, ref_kl)]
    config = SimpleNamespace(data=DataConfig(format="unpaired", path="unused", max_seq_len=64))
    objective = KTO(KtoSection(beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1]),
                    "precomputed", config, None)
    objective.accelerator = SimpleNamespace(num_processes=1)
    batch = objective.micro_batch(ours_rows, pad_id, "cpu", select_logits=True)
    with torch.no_grad():
        loss = float(objective.loss(model, batch) / batch.num_targets)
    got = objective.take_metrics(SimpleNamespace(num_processes=1))
    # TRL sums its fused head's per-token log-probs (tiles), hfsdp its cross entropy's: float32 sums in another
    # order, within 4e-7 of the largest log-prob (about 3 ulps for each sum in a difference); rewards times beta
    # (a CI machine measured 1.5e-5 on rewards/rejected at beta 2, log-probs near -60)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
    assert set(got) == set(names)
    logps = max(abs(want["logps/chosen"]), abs(want["logps/rejected"]))
    for name in names:
        near = 4e-7 * logps * (beta if name.startswith("rewards/") else 1.0)
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=max(near, 1e-6)), name


def test_the_adapter_route_is_the_base_with_the_adapters_disabled(models_and_rows):
    """With LoRA (adapters away from their zero start), the adapter route's loss and metrics are those of the
    precomputed route given the base model's log-probs of the rows and KL rows (the adapters disabled)."""
    from peft import LoraConfig, get_peft_model

    from hfsdp.builtin.kto import KtoSection
    from hfsdp.builtin.kto.loss import KTO
    from hfsdp.config.schema import DataConfig

    model, _, rows, pad_id = models_and_rows
    torch.manual_seed(2)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    config = SimpleNamespace(data=DataConfig(format="unpaired", path="unused", max_seq_len=64))
    section = KtoSection(beta=2.0, undesirable_weight=1.33)

    def run(reference: str, rows_given) -> tuple[float, dict]:
        objective = KTO(section, reference, config, None)
        objective.accelerator, objective.unwrapped = SimpleNamespace(num_processes=1), peft
        batch = objective.micro_batch(rows_given, pad_id, "cpu", select_logits=True)
        with torch.no_grad():
            loss = float(objective.loss(peft, batch) / batch.num_targets)
        return loss, objective.take_metrics(SimpleNamespace(num_processes=1))

    try:
        base = KTO(section, "precomputed", config, None)
        base.unwrapped = peft
        with torch.no_grad(), peft.disable_adapter():
            ref, ref_kl = base.completion_logps(peft, base.micro_batch(rows, pad_id, "cpu", select_logits=True))
        adapter = run("adapter", rows)
        precomputed = run("precomputed", [r | {"ref_logps": float(a), "ref_KL_logps": float(b)}
                                          for r, a, b in zip(rows, ref, ref_kl)])
    finally:
        peft.unload()  # the module fixture's model without adapters again
    assert adapter[0] == pytest.approx(precomputed[0], rel=1e-6)
    assert adapter[1] == pytest.approx(precomputed[1], rel=1e-6, abs=1e-7)
    assert abs(adapter[1]["rewards/chosen"]) > 1e-3  # the adapters moved the policy away from the base


def test_kl_rows_rotate_completions_within_chunks(models_and_rows):
    """Row i's KL row is its prompt with row i-1's completion, the first row taking its chunk's last (chunks of 2)."""
    from datasets import Dataset

    from hfsdp.builtin.kto.loss import with_kl_rows

    _, _, rows, _ = models_and_rows
    plain = Dataset.from_list([{k: r[k] for k in ("input_ids", "labels", "label")} for r in rows])
    kl = list(with_kl_rows(plain, 2, 64))
    examples = trl_examples(rows)
    for i, partner in enumerate([1, 0, 3, 2]):
        assert kl[i]["KL_input_ids"] == examples[i]["prompt_ids"] + examples[partner]["completion_ids"]
        assert [t for t in kl[i]["KL_labels"] if t != -100] == examples[partner]["completion_ids"]


@pytest.mark.parametrize("row,says", [
    ({"prompt": "Hi", "completion": "there", "label": "yes"}, "label 'yes' is not true or false"),
    ({"prompt": "Hi", "completion": "", "label": True}, "the completion is empty"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": "there", "label": False}, "mix a text"),
    ({"prompt": "Hi", "label": True}, "the completion is missing"),
])
def test_validate_names_the_first_bad_unpaired_row(tmp_path, row, says):
    import json

    from conftest import run_cli, tiny_config

    good = {"prompt": "Q: 1+1?", "completion": " 2", "label": True}
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (good, good, row)) + "\n")
    config = tiny_config(tmp_path, plugins=["kto"], data={"format": "unpaired", "path": str(data), "eval_path": None},
                         train={"per_device_batch_size": 2})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr, proc.stderr
    assert f"line 3 of {data}" in proc.stderr, proc.stderr


UNPAIRED = {"format": "unpaired", "eval_path": None}


@pytest.mark.parametrize("plugins,sections,says", [
    (["kto", "packing"], {"packing": {"scope": "dataset"}},
     "packing.scope: unpaired rows are scored whole (a pair side by side, a row beside its KL row"),
    (["kto", "grpo"], {"grpo": {"rewards": [{"name": "json_fields"}]}},
     "grpo generates completions of prompts: set data.format: prompt"),
    (["kto", "dpo"], {}, "dpo trains on preference rows"),
    (["kto"], {"data": {"format": "preference"}}, "kto trains on unpaired rows (prompt, completion, label)"),
    (["kto"], {"kto": {"reference": "adapter"}}, "adapter: the reference is the base model with the LoRA adapters"),
    (["kto"], {"train": {"per_device_batch_size": 1}}, "at least 2 rows per rank"),
])
def test_what_kto_cannot_combine_with_is_refused_before_any_weight_loads(tmp_path, plugins, sections, says):
    from conftest import PRESET_DATA, run_cli, tiny_config

    data = {**UNPAIRED, "path": str(PRESET_DATA / "contacts_unpaired_train.jsonl"), **sections.pop("data", {})}
    config = tiny_config(tmp_path, plugins=plugins, data=data, **sections)
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr
