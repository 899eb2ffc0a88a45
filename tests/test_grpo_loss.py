"""GRPO's loss (hfsdp.builtin.grpo.loss) against TRL 1.16's own GRPOTrainer._compute_loss on fixed tensors, one
process, two micro-batches of accumulation: for every loss_type, beta 0 and > 0, num_iterations 1 (the old log-probs
are the log-probs detached) and 2 (old log-probs kept), the summed loss and its gradient with respect to the
per-token log-probs are TRL's (TRL computes each micro-batch's loss divided by the accumulation; hfsdp sums each
micro-batch's loss in its units and divides by the global batch's). Also TRL's advantages (group and batch
scaling, a None reward)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hfsdp.builtin.grpo import GrpoSection
from hfsdp.builtin.grpo.loss import advantages_of, token_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

MAX_NEW = 6
MICRO = 2  # micro-batches of accumulation
ROWS = 4  # completions per micro-batch


def fixed_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_NEW + 1, (MICRO, ROWS), generator=g)
    mask = torch.arange(MAX_NEW)[None, None] < lengths[..., None]  # [micro, rows, tokens]
    logps = -torch.rand(MICRO, ROWS, MAX_NEW, generator=g) * 3
    old = logps + 0.3 * torch.randn(MICRO, ROWS, MAX_NEW, generator=g)  # far enough to clip some tokens
    ref = logps + 0.5 * torch.randn(MICRO, ROWS, MAX_NEW, generator=g)
    adv = torch.randn(MICRO, ROWS, generator=g)
    return mask, logps, old, ref, adv


def trl_loss(section: GrpoSection, iterations: int, mask, logps, old, ref, adv):
    """Sum over the micro-batches of TRL's _compute_loss, and the gradient wrt the log-probs."""
    leaf = logps.clone().requires_grad_(True)
    total = 0.0
    for m in range(MICRO):
        host = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, m=m, **k: (leaf[m], torch.zeros(ROWS, MAX_NEW), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
            beta=section.beta, loss_type=section.loss_type, epsilon_low=section.epsilon,
            epsilon_high=section.epsilon_high or section.epsilon, use_vllm=False,
            vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=MICRO, max_completion_length=MAX_NEW, aux_loss_enabled=False,
            _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
            args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=MICRO),
            accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t))
        inputs = {"prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 1),
                  "completion_ids": torch.zeros(ROWS, MAX_NEW, dtype=torch.long), "completion_mask": mask[m].long(),
                  "advantages": adv[m], "num_items_in_batch": mask.sum().float()}
        if iterations > 1:
            inputs["old_per_token_logps"] = old[m]
        if section.beta:
            inputs["ref_per_token_logps"] = ref[m]
        total = total + trl_grpo.GRPOTrainer._compute_loss(host, None, inputs)
    total.backward()
    return float(total.detach()), leaf.grad


def hfsdp_loss(section: GrpoSection, iterations: int, mask, logps, old, ref, adv):
    leaf = logps.clone().requires_grad_(True)
    units = int(mask.sum()) if section.loss_type == "dapo" else MICRO * ROWS  # the global batch's units
    total = 0.0
    for m in range(MICRO):
        kept = old[m] if iterations > 1 else leaf[m].detach()
        part, _ = token_loss(leaf[m], kept, adv[m], ref[m] if section.beta else None, mask[m], section, MAX_NEW)
        total = total + part / units
    total.backward()
    return float(total.detach()), leaf.grad


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_the_loss_and_its_gradient_are_trls(loss_type, beta, iterations):
    section = GrpoSection(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                          rewards=[{"name": "json_fields"}])
    tensors = fixed_inputs()
    ours, our_grad = hfsdp_loss(section, iterations, *tensors)
    theirs, their_grad = trl_loss(section, iterations, *tensors)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert torch.allclose(our_grad, their_grad, rtol=1e-5, atol=1e-7)
    assert our_grad.abs().sum() > 0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_are_trls(scale):
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(8, 2, generator=g)
    rewards[3, 1] = float("nan")  # one function gave no reward there
    weights = torch.tensor([1.0, 0.5])
    total = (rewards * weights).nansum(1)
    mean = total.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(total.view(-1, 4), dim=1).repeat_interleave(4) if scale != "batch" else nanstd(total).expand(8)
    expected = (total - mean) / (std + 1e-4) if scale != "none" else total - mean
    assert torch.allclose(advantages_of(rewards, weights, 4, scale), expected, rtol=1e-6, atol=1e-7)


def test_json_fields_is_the_share_of_expected_fields_right():
    from hfsdp.builtin.grpo import json_fields

    answer = '{"name": "Olga Khan", "age": 30, "city": "Nairobi", "job": "chef"}'
    completions = [[{"role": "assistant", "content": answer}],
                   [{"role": "assistant", "content": 'Sure: {"name": "Olga Khan", "age": "30", "city": "Nairobi"}'}],
                   "not JSON at all", '{"name": "Olga Khan", "age": 30, "city": "Lima", "job": "chef"} and more']
    assert json_fields(completions, answer=[answer] * 4) == [1.0, 0.5, 0.0, 0.75]


@pytest.mark.parametrize("select_logits", [True, False])
def test_a_completions_log_probs_do_not_depend_on_the_rows_beside_it(tiny_model_dir, select_logits):
    """``prompt_completion_batch`` (TRL's layout: prompts left-padded, completions right-padded, positions counted from
    each row's first token): a row's per-token log-probs in a micro-batch of prompts and completions of other lengths
    are its log-probs alone, within float32 rounding; with ``select_logits`` only the longest completion's positions
    get logits."""
    from transformers import AutoModelForCausalLM

    from hfsdp import IGNORE_INDEX
    from hfsdp.builtin.online.sampler import prompt_completion_batch, token_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
    completions = [[40, 41], [50, 51, 52, 53, 54], [60]]
    with torch.no_grad():
        batch = prompt_completion_batch(prompts, completions, 0, "cpu", select_logits)
        together = token_logps(model, batch, 0.7)[0]
        mask = batch.targets != IGNORE_INDEX
        assert batch.targets.shape[1] == (5 if select_logits else 7 + 5)
        assert batch.num_targets == 8 and mask.sum(1).tolist() == [2, 5, 1]
        for i, (p, c) in enumerate(zip(prompts, completions)):
            single = prompt_completion_batch([p], [c], 0, "cpu", select_logits)
            alone = token_logps(model, single, 0.7)[0]
            got, want = together[i][mask[i]], alone[0][single.targets[0] != IGNORE_INDEX]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (i, got, want)
