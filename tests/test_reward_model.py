"""Reward modelling (plugin ``reward_model``, :mod:`hfsdp.builtin.reward_model`): the loss and every logged metric
equal TRL 1.16 ``RewardTrainer.compute_loss``'s on the same rows and model (TRL's own method, called on the shrunk
SmolLM2 turned into its sequence-classification model), with a margin column and ``center_rewards_coefficient``;
the preference format's margin column and its refusal of a margin that is not a number. Through the real CLI:
tests/test_combinations.py (the smoke and resume matrices, the export loaded by ``AutoModelForSequenceClassification``
and 2 ranks computing what one process computes). The 6-step training comparison against TRL is
``benchmarks/trl_preference.py reward_model`` (not in CI)."""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from conftest import PRESET_DATA, run_cli, tiny_config

PROMPTS = [("Q: 2+2?", " 4", " five"), ("Q: name a colour.", " Blue, the colour of the sky.", " 7"),
           ("Say hi.", " hi", " Good morning to you, dear friend!")]
MARGINS = [0.5, 0.0, 2.0]
# hfsdp's metric -> TRL RewardTrainer's
NAMES = {"rewards/accuracy": "accuracy", "rewards/margins": "margin", "rewards/mean": "mean_reward",
         "rewards/min": "min_reward", "rewards/max": "max_reward"}


@pytest.fixture(scope="module")
def model_and_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.builtin.reward_model.model import sequence_classifier
    from hfsdp.config.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="preference", path="unused", max_seq_len=64)
    rows = [tokenize_pair(*p, tokenizer, cfg) | {"margin": m} for p, m in zip(PROMPTS, MARGINS)]
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = sequence_classifier(causal, tokenizer.pad_token_id, seed=3).eval()
    return model, rows, tokenizer.pad_token_id


def trl_loss(model, rows, pad_id: int, margin: bool, center: float | None) -> tuple[float, dict[str, float]]:
    """TRL's compute_loss on TRL's collation of the same token ids, with the state it reads (no Trainer)."""
    from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

    examples = [{"chosen_ids": r["input_ids"], "rejected_ids": r["rejected_input_ids"],
                 **({"margin": r["margin"]} if margin else {})} for r in rows]
    inputs = DataCollatorForPreference(pad_token_id=pad_id)(examples)
    trainer = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=center),
                              accelerator=SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1)
    with torch.no_grad():
        loss = RewardTrainer.compute_loss(trainer, model, inputs)
    return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("margin,center", [(False, None), (True, 0.01)])
def test_loss_and_metrics_equal_trls_reward_trainer(model_and_rows, margin, center):
    from hfsdp.builtin.reward_model import RewardModelSection
    from hfsdp.builtin.reward_model.loss import RewardModel

    model, rows, pad_id = model_and_rows
    want_loss, want = trl_loss(model, rows, pad_id, margin, center)
    objective = RewardModel(RewardModelSection(margin=margin, center_rewards_coefficient=center))
    batch = objective.micro_batch(rows, pad_id, "cpu", select_logits=True)
    with torch.no_grad():
        loss = float(objective.loss(model, batch) / batch.num_targets)
    got = objective.take_metrics(SimpleNamespace(num_processes=1))
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert set(got) == set(NAMES) | {"rewards/chosen", "rewards/rejected"}
    for ours, theirs in NAMES.items():
        assert got[ours] == pytest.approx(want[theirs], rel=1e-6, abs=1e-7), ours
    # each row's reward is the same alone, without the padding the pair's other rows gave it
    with torch.no_grad():
        alone = [float(model(input_ids=torch.tensor([r["input_ids"]])).logits) for r in rows]
    assert got["rewards/chosen"] == pytest.approx(sum(alone) / len(alone), rel=1e-5)


def test_the_head_is_new_the_base_is_the_causal_lms(tiny_model_dir, model_and_rows):
    model, _, pad_id = model_and_rows
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == pad_id
    assert torch.equal(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)
    assert model.score.weight.shape == (1, causal.config.hidden_size)
    assert 0.01 < float(model.score.weight.std()) < 0.03  # initializer_range 0.02


def test_a_margin_that_is_not_a_number_is_refused_naming_the_row(tmp_path):
    rows = [json.loads(line) for line in (PRESET_DATA / "contacts_pref_train.jsonl").read_text().splitlines()[:5]]
    for i, row in enumerate(rows):
        row["margin"] = "high" if i == 3 else 0.5 * i
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(tmp_path, plugins=["reward_model"], reward_model={"margin": True},
                         data={"format": "preference", "path": str(data), "eval_path": None})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "line 4 of" in proc.stderr and "margin 'high' is not a number" in proc.stderr, proc.stderr[-2000:]
