"""Reference-free preference losses (plugins ``orpo`` and ``simpo``, :mod:`hfsdp.builtin.reference_free.loss`): the
loss and every logged metric equal TRL 1.16's ``ORPOTrainer`` and ``CPOTrainer(loss_type="simpo")`` on the same rows and
model (TRL's own methods, called on the shrunk SmolLM2, not copies of their formulas). Through the real CLI:
tests/test_combinations.py (the smoke and resume matrices, and 2 ranks computing what one process computes, the
NLL term being a token mean over the global batch). The 6-step training comparison against TRL is
benchmarks/trl_preference.py (not in CI)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

PROMPTS = [("Q: 2+2?", " 4", " five"), ("Q: name a colour.", " Blue, the colour of the sky.", " 7"),
           ("Say hi.", " hi", " Good morning to you, dear friend!")]


def trl_batch(rows, pad_id: int) -> dict[str, torch.Tensor]:
    """hfsdp's tokenized rows as TRL's CPO/ORPO collator gives them (right-padded, labels -100 outside)."""
    from trl.trainer.utils import pad

    out = {}
    for side, ids, labels in (("chosen", "input_ids", "labels"), ("rejected", "rejected_input_ids", "rejected_labels")):
        out[f"{side}_input_ids"] = pad([torch.tensor(r[ids]) for r in rows], padding_value=pad_id)
        out[f"{side}_attention_mask"] = pad([torch.ones(len(r[ids]), dtype=torch.long) for r in rows], padding_value=0)
        out[f"{side}_labels"] = pad([torch.tensor(r[labels]) for r in rows], padding_value=-100)
    return out


def trl_trainer(cls, pad_id: int, **attributes):
    """The state TRL's loss methods read, without a Trainer (no training here: one batch's loss and metrics)."""
    trainer = SimpleNamespace(is_encoder_decoder=False, pad_token_id=pad_id, padding_value=pad_id,
                              aux_loss_enabled=False, alpha=0.0,
                              label_smoothing=0.0, accelerator=SimpleNamespace(device="cpu",
                                                                               gather_for_metrics=lambda t: t),
                              concatenated_inputs=cls.concatenated_inputs, get_batch_logps=cls.get_batch_logps,
                              **attributes)
    for method in ("concatenated_forward", "odds_ratio_loss", "cpo_loss"):
        if hasattr(cls, method):
            setattr(trainer, method, getattr(cls, method).__get__(trainer))
    return trainer


@pytest.fixture(scope="module")
def model_and_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.config.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="preference", path="unused", max_seq_len=64)
    rows = [tokenize_pair(*p, tokenizer, cfg) for p in PROMPTS]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, rows, tokenizer.pad_token_id


def ours(objective, model, rows, pad_id: int) -> tuple[float, dict[str, float]]:
    batch = objective.micro_batch(rows, pad_id, "cpu", select_logits=True)
    objective.start_step(SimpleNamespace(num_processes=1), [batch])
    with torch.no_grad():
        loss = objective.loss(model, batch) / batch.num_targets
    return float(loss), objective.take_metrics(SimpleNamespace(num_processes=1))


def assert_same(got: tuple[float, dict], want_loss: torch.Tensor, want_metrics: dict, names: dict[str, str]):
    loss, metrics = got
    assert loss == pytest.approx(float(want_loss), rel=1e-6, abs=1e-7)
    assert set(metrics) == set(names)
    # A margin is a difference of two rewards: within a float32 rounding (2**-22 relative, two ulps) of them.
    operands = max(abs(float(want_metrics[k])) for k in ("rewards/chosen", "rewards/rejected"))
    for ours_name, trl_name in names.items():
        slack = max(1e-6, 2 ** -22 * operands) if ours_name == "rewards/margins" else 1e-6
        assert metrics[ours_name] == pytest.approx(float(want_metrics[trl_name]), rel=1e-5, abs=slack), ours_name


SHARED = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
          "rewards/margins": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
          "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected", "nll_loss": "nll_loss"}


def test_orpo_loss_and_metrics_equal_trls_orpo_trainer(model_and_rows):
    from trl.experimental.orpo import ORPOTrainer

    from hfsdp.builtin.orpo.schema import OrpoSection
    from hfsdp.builtin.reference_free.loss import ORPO

    model, rows, pad_id = model_and_rows
    trainer = trl_trainer(ORPOTrainer, pad_id, beta=0.25)
    with torch.no_grad():
        want_loss, want = ORPOTrainer.get_batch_loss_metrics(trainer, model, trl_batch(rows, pad_id))
    got = ours(ORPO(OrpoSection(beta=0.25)), model, rows, pad_id)
    assert_same(got, want_loss, want, {**SHARED, "log_odds_ratio": "log_odds_ratio",
                                       "log_odds_chosen": "log_odds_chosen"})


@pytest.mark.parametrize("nll_weight", [0.0, 1.0])
def test_simpo_loss_and_metrics_equal_trls_cpo_trainer(model_and_rows, nll_weight):
    from trl.experimental.cpo import CPOTrainer

    from hfsdp.builtin.reference_free.loss import SimPO
    from hfsdp.builtin.simpo.schema import SimpoSection

    model, rows, pad_id = model_and_rows
    trainer = trl_trainer(CPOTrainer, pad_id, beta=2.0, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=nll_weight)
    with torch.no_grad():
        want_loss, want = CPOTrainer.get_batch_loss_metrics(trainer, model, trl_batch(rows, pad_id))
    got = ours(SimPO(SimpoSection(beta=2.0, gamma=0.7, nll_weight=nll_weight)), model, rows, pad_id)
    names = SHARED if nll_weight else {k: v for k, v in SHARED.items() if k != "nll_loss"}
    assert_same(got, want_loss, want, names)


def test_the_odds_ratio_is_stable_near_zero_and_far_below():
    """log(1 - e^x) without cancellation both near 0 (a near-certain completion) and far below (a long one)."""
    from hfsdp.builtin.reference_free.loss import log1mexp

    x = torch.tensor([-1e-7, -0.5, -0.7, -30.0], dtype=torch.float64)
    assert torch.allclose(log1mexp(x.float()).double(), torch.log(-torch.expm1(x)), rtol=1e-6)


def test_log_probs_are_their_logit_minus_the_logsumexp_as_trls():
    """``target_logps`` (the log-probs of DPO, ORPO, SimPO, KTO and GRPO): TRL's ``selective_log_softmax``, within
    float32 rounding (2e-7 relative) of a float64 computation over SmolLM2's vocabulary (a float32 log_softmax's
    sum is about 1e-5 off on this CPU: ORPO's logged log-probs were 1.3e-5 from TRL's before any update), 0 at
    unlabelled positions."""
    from trl.trainer.utils import selective_log_softmax

    from hfsdp import IGNORE_INDEX
    from hfsdp.objective import target_logps

    torch.manual_seed(0)
    logits = torch.randn(3, 20, 49152) * 4 + 2
    targets = torch.randint(0, 49152, (3, 20))
    targets[:, :5] = IGNORE_INDEX
    ours = target_logps(logits, targets)
    wide = logits.double()
    exact = (wide.gather(-1, targets.clamp(min=0)[..., None])[..., 0] - wide.logsumexp(-1)) * (targets >= 0)
    assert ((ours.double() - exact).abs() <= 2e-7 * exact.abs()).all()  # a float32 rounding of the result, or two
    assert torch.equal(ours[:, :5], torch.zeros(3, 5))
    theirs = selective_log_softmax(logits, targets.clamp(min=0)) * (targets >= 0)
    assert ((ours - theirs).abs() <= 2e-7 * exact.abs()).all()
