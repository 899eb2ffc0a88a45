"""GRPO's loss (hfsdp.builtin.grpo.loss) against TRL 1.16's own GRPOTrainer._compute_loss on fixed tensors, one
process, two micro-batches of accumulation: for every loss_type, beta 0 and > 0 (with and without the KL's bias
correction), num_iterations 1 (the old log-probs are the log-probs detached) and 2 (old log-probs kept), token and
sequence importance sampling, two-sided clipping (delta), the off-policy sequence mask, truncated completions left
out (hfsdp's own micro-batches against TRL's mask) and the top entropy quantile, the summed loss and its gradient
with respect to the per-token log-probs are TRL's within 1e-6 (TRL computes each micro-batch's loss divided by the
accumulation; hfsdp sums each micro-batch's loss in its units and divides by the global batch's). Also TRL's
advantages (group and batch scaling, a None reward, both multi_objective_aggregation modes).

The importance-sampling correction of an engine beside the trainer (TRL's vllm_importance_sampling_correction): the
ratio and the sampling/ metrics are those of TRL's own lines of _generate_and_score_completions, cut from its source
and run on the test's tensors (one process's generation batch: the round); hfsdp's round keeps the log-probs as
per-completion lists at the labelled tokens, made into micro-batches by GRPO._batch; every mode and clip bounds, with
and without tool results and truncated completions, a token the sampler did not score (NaN)."""

from __future__ import annotations

import inspect
import textwrap
import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.grpo import GrpoSection
from hfsdp.builtin.grpo.loss import (GRPO, TOKEN_MEAN_LOSSES, advantages_of, entropy_threshold, high_entropy,
                                     token_loss)
from hfsdp.builtin.online.correction import importance_sampling_ratio, round_logps
from hfsdp.builtin.online.rounds import per_row

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

MAX_NEW = 6
MICRO = 2  # micro-batches of accumulation
ROWS = 4  # completions per micro-batch
LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
REL = 1e-6
EOS, PAD = 2, 0


def fixed_inputs(seed: int = 0):
    """[micro, rows, tokens] mask, log-probs, old and reference log-probs, [micro, rows] advantages, and entropies;
    some completions of the full MAX_NEW tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_NEW + 1, (MICRO, ROWS), generator=g)
    lengths[:, 0] = MAX_NEW
    mask = torch.arange(MAX_NEW)[None, None] < lengths[..., None]  # [micro, rows, tokens]
    logps = -torch.rand(MICRO, ROWS, MAX_NEW, generator=g) * 3
    old = logps + 0.3 * torch.randn(MICRO, ROWS, MAX_NEW, generator=g)  # far enough to clip some tokens
    ref = logps + 0.5 * torch.randn(MICRO, ROWS, MAX_NEW, generator=g)
    adv = torch.randn(MICRO, ROWS, generator=g)
    entropies = torch.rand(MICRO, ROWS, MAX_NEW, generator=g) * 4
    return mask, logps, old, ref, adv, entropies


def split(tensors, micro: int):
    """The same global batch in ``micro`` micro-batches."""
    return [t.reshape(micro, -1, *t.shape[2:]) for t in tensors]


def trl_host(section: GrpoSection, micro: int, leaf, entropies, m: int):
    """What TRL's _compute_loss reads of its trainer, from ``section``, on one process."""
    args = {k: getattr(section, k) for k in ("use_bias_correction_kl", "delta", "sapo_temperature_pos",
                                             "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                                             "vespo_k_neg", "vespo_lambda_neg")}
    host = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf[m], entropies[m], None),
        top_entropy_quantile=section.top_entropy_quantile, off_policy_mask_threshold=section.off_policy_mask_threshold,
        importance_sampling_level=section.importance_sampling_level, get_off_policy_mask=trl_grpo.GRPOTrainer.
        get_off_policy_mask, get_gamma_weights=trl_grpo.GRPOTrainer.get_gamma_weights,
        beta=section.beta, loss_type=section.loss_type, epsilon_low=section.epsilon,
        epsilon_high=section.epsilon_high or section.epsilon, use_vllm=section.generation.beside,
        vllm_importance_sampling_correction=section.generation.importance_sampling_correction,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=micro, max_completion_length=MAX_NEW, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(**args, steps_per_generation=micro),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                    pad_across_processes=lambda t, dim, pad_index: t))
    host.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, host)
    return host


def trl_loss(section: GrpoSection, iterations: int, mask, logps, old, ref, adv, entropies, extra=None):
    """Sum over the micro-batches (the tensors' first dimension) of TRL's _compute_loss, and the gradient wrt the
    log-probs; ``extra``: more of its inputs, ``[micro, ...]`` tensors (a ``tool_mask`` counts in
    ``num_items_in_batch`` as TRL counts it)."""
    micro = mask.size(0)
    extra = extra or {}
    leaf = logps.clone().requires_grad_(True)
    total = 0.0
    for m in range(micro):
        rows = mask.size(1)
        inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
                  "completion_ids": torch.zeros(rows, MAX_NEW, dtype=torch.long), "completion_mask": mask[m].long(),
                  "advantages": adv[m], "num_items_in_batch": (mask * extra.get("tool_mask", 1)).sum().float(),
                  **{k: v[m] for k, v in extra.items()}}
        if iterations > 1:
            inputs["old_per_token_logps"] = old[m]
        if section.beta:
            inputs["ref_per_token_logps"] = ref[m]
        total = total + trl_grpo.GRPOTrainer._compute_loss(trl_host(section, micro, leaf, entropies, m), None, inputs)
    total.backward()
    return float(total.detach()), leaf.grad


def hfsdp_loss(section: GrpoSection, iterations: int, mask, logps, old, ref, adv, entropies):
    """hfsdp's loss over the micro-batches, each divided by the global batch's units; with top_entropy_quantile < 1
    the threshold is the global batch's (GRPO.start_step)."""
    micro, rows = mask.shape[:2]
    leaf = logps.clone().requires_grad_(True)
    units = int(mask.sum()) if section.loss_type in TOKEN_MEAN_LOSSES else micro * rows  # the global batch's units
    threshold = None
    if section.top_entropy_quantile < 1:
        threshold = entropy_threshold(entropies[mask], section.top_entropy_quantile)
    total = 0.0
    for m in range(micro):
        kept = old[m] if iterations > 1 else leaf[m].detach()
        keep = high_entropy(entropies[m], mask[m], threshold) if threshold is not None else None
        part, _ = token_loss(leaf[m], kept, adv[m], ref[m] if section.beta else None, mask[m], section, MAX_NEW,
                             keep)
        total = total + part / units
    total.backward()
    return float(total.detach()), leaf.grad


def section_of(**keys) -> GrpoSection:
    return GrpoSection(**{"epsilon": 0.2, "epsilon_high": 0.28, "rewards": [{"name": "json_fields"}], **keys})


def assert_trls(section: GrpoSection, iterations: int, ours_in, theirs_in=None):
    ours, our_grad = hfsdp_loss(section, iterations, *ours_in)
    theirs, their_grad = trl_loss(section, iterations, *(theirs_in or ours_in))
    our_grad, their_grad = our_grad.reshape(their_grad.shape), their_grad
    assert ours == pytest.approx(theirs, rel=REL, abs=1e-8), (ours, theirs)
    assert torch.allclose(our_grad, their_grad, rtol=REL, atol=1e-8), (our_grad - their_grad).abs().max()
    assert our_grad.abs().sum() > 0


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_and_its_gradient_are_trls(loss_type, beta, iterations):
    assert_trls(section_of(loss_type=loss_type, beta=beta), iterations, fixed_inputs())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_level_importance_sampling_is_trls(loss_type):
    """GSPO's ratio per completion, with every loss type TRL computes it with (it warns of some), the KL's bias
    correction (a completion's ratio on each of its tokens) and without."""
    for bias_correction in (True, False):
        section = section_of(loss_type=loss_type, importance_sampling_level="sequence", beta=0.04,
                             use_bias_correction_kl=bias_correction)
        assert_trls(section, 2, fixed_inputs())


# Each loss type's own parameters away from their defaults (delta: two-sided clipping; cispo's cap; sapo's
# temperatures; vespo's k and lambda), and the off-policy sequence mask (which drops some completions here).
PARAMETERS = {"grpo": {"delta": 1.15}, "dapo": {"delta": 1.15}, "luspo": {"delta": 1.15}, "cispo": {"epsilon_high": 1.1},
              "sapo": {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
              "vespo": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0, "vespo_lambda_neg": 4.0}}


@pytest.mark.parametrize("keys", [{"loss_type": t, **p} for t, p in PARAMETERS.items()]
                         + [{"loss_type": t, "off_policy_mask_threshold": 0.15} for t in LOSS_TYPES],
                         ids=lambda keys: "-".join(f"{k}={v}" for k, v in keys.items()))
def test_loss_parameters_are_trls(keys):
    """The loss with the parameters is TRL's, and not the loss without them (each acted)."""
    tensors = fixed_inputs()
    section = section_of(**keys, beta=0.04)
    assert_trls(section, 2, tensors)
    default = section_of(loss_type=keys["loss_type"], beta=0.04)
    assert hfsdp_loss(section, 2, *tensors)[0] != pytest.approx(hfsdp_loss(default, 2, *tensors)[0], rel=1e-4)


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])
@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_the_top_entropy_quantile_is_trls_on_one_process_whatever_the_micro_batches(loss_type, quantile):
    """hfsdp's threshold is the quantile of the global batch's entropies: in 2 micro-batches, it is TRL's on one
    micro-batch of the whole batch (TRL's quantile is per micro-batch; bnpo's mean is one too, so it is left out)."""
    section = section_of(loss_type=loss_type, top_entropy_quantile=quantile, beta=0.04)
    tensors = fixed_inputs()
    assert_trls(section, 2, tensors, split(tensors, 1))
    threshold = entropy_threshold(tensors[-1][tensors[0]], quantile)
    kept = high_entropy(tensors[-1], tensors[0], threshold)
    assert 0 < kept.sum() < tensors[0].sum()


class _Model:
    """What GRPO._batch reads of the model: its generation config's EOS ids."""
    generation_config = SimpleNamespace(eos_token_id=[EOS, 3])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_truncated_completions_are_left_out_as_trl_leaves_them_out(loss_type):
    """``mask_truncated_completions``: hfsdp's micro-batches (GRPO._batch) unlabel the completions that end in neither
    EOS nor the pad token; their loss and units are TRL's with its completion mask of truncated completions zeroed
    (TRL's lines, _generate_and_score_completions) and its num_items_in_batch counted after."""
    section = section_of(loss_type=loss_type, mask_truncated_completions=True, beta=0.04)
    mask, logps, old, ref, adv, entropies = fixed_inputs()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 50, (MICRO, ROWS, MAX_NEW), generator=g)
    ends = [[[EOS, 9, 3, PAD][(m + r) % 4] for r in range(ROWS)] for m in range(MICRO)]  # 9: truncated
    objective = GRPO(section, [], None, SimpleNamespace(eos_token_id=EOS))
    objective.unwrapped = _Model()
    ours, trl_mask, units = [], [], 0
    for m in range(MICRO):
        completions = [ids[m, r, :int(mask[m, r].sum())].tolist() for r in range(ROWS)]
        for c, end in zip(completions, ends[m]):
            c[-1] = end if len(c) == MAX_NEW else EOS  # a short completion stopped at EOS
        entry = {"prompt_ids": [[5, 6]] * ROWS, "completion_ids": completions, "advantages": adv[m].tolist()}
        batch = objective._batch(entry, PAD, "cpu", select_logits=True)
        labelled = torch.zeros(ROWS, MAX_NEW, dtype=torch.bool)
        labelled[:, :batch.targets.size(1)] = batch.targets != IGNORE_INDEX
        ours.append(labelled)
        units += batch.num_targets
        eos_and_pad = [EOS, 3, PAD]  # TRL: completion_mask * (~is_truncated), is_truncated = ids[-1] not in these
        is_truncated = torch.tensor([c[-1] not in eos_and_pad for c in completions])
        trl_mask.append(mask[m].int() * (~is_truncated).unsqueeze(1).int())
    ours, trl_mask = torch.stack(ours), torch.stack(trl_mask).bool()
    assert torch.equal(ours, trl_mask) and 0 < ours.sum() < mask.sum()
    expected_units = int(trl_mask.sum()) if loss_type in TOKEN_MEAN_LOSSES else MICRO * ROWS
    assert (units if loss_type in TOKEN_MEAN_LOSSES else MICRO * ROWS) == expected_units
    assert_trls(section, 2, (ours, logps, old, ref, adv, entropies), (trl_mask, logps, old, ref, adv, entropies))


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
    assert torch.equal(advantages_of(rewards, weights, 4, scale, "sum_then_normalize"),
                       advantages_of(rewards, weights, 4, scale))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_normalize_then_sum_advantages_are_trls(scale):
    """GDPO: TRL's lines (_generate_and_score_completions, normalize_then_sum), with a None reward and a completion
    no function scored; scale_rewards does not enter."""
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(8, 3, generator=g) * torch.tensor([1.0, 5.0, 0.1])
    rewards[3, 1] = float("nan")
    rewards[6] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])
    grouped = rewards.view(-1, 4, 3)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, 3)
    summed = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(rewards).all(dim=1)] = torch.nan
    expected = torch.nan_to_num((summed - torch.nanmean(summed)) / (nanstd(summed).expand_as(summed) + 1e-4), nan=0.0)
    got = advantages_of(rewards, weights, 4, scale, "normalize_then_sum")
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), (got, expected)
    assert got[6] == 0 and not torch.allclose(got, advantages_of(rewards, weights, 4, scale), atol=1e-3)


def test_json_fields_is_the_share_of_expected_fields_right():
    from hfsdp.builtin.online.rewards import json_fields

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
    from hfsdp.builtin.online.rounds import prompt_completion_batch, token_logps

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


# ---- the importance-sampling correction of an engine beside the trainer (TRL's vllm_importance_sampling_correction)

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CLIPS = [(None, 3.0), (0.8, 1.25)]  # TRL's default bounds; both sides of 1 (each binds on kept_round's tensors)
TRUNCATED = 9  # a completion's last token that is neither EOS nor the pad token: cut at MAX_NEW


def trl_lines(first: str, last: str) -> str:
    """TRL's own lines of GRPOTrainer._generate_and_score_completions from the one containing ``first`` up to the
    one containing ``last`` (left out), dedented, to run as they stand."""
    lines = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return textwrap.dedent("\n".join(lines[start:end]))


def trl_sampling(section: GrpoSection, old, sampler, completion_mask, tool_mask):
    """TRL's importance-sampling ratio and its ``sampling/`` metrics of one process's generation batch
    (``[completions, tokens]``), by TRL's own lines (the ratio's block, then the metrics' block under its
    ``if self.use_vllm and self.vllm_importance_sampling_correction``) run on these tensors."""
    g = section.generation
    host = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode=g.importance_sampling_mode,
                           vllm_importance_sampling_clip_min=g.importance_sampling_clip_min,
                           vllm_importance_sampling_clip_max=g.importance_sampling_clip_max,
                           _metrics={"train": defaultdict(list)}, accelerator=SimpleNamespace(gather=lambda t: t))
    scope = {**vars(trl_grpo), "self": host, "old_per_token_logps": old, "sampling_per_token_logps": sampler,
             "completion_mask": completion_mask, "tool_mask": tool_mask, "device": torch.device("cpu"),
             "mode": "train"}
    exec(trl_lines("# Compute the importance sampling ratio when using vLLM",
                   "# Compute the per-token log probabilities for the reference model"), scope)
    exec(trl_lines("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {"), scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[0] for k, v in host._metrics["train"].items()}


def beside(mode: str = "sequence_mask", clip=(None, 3.0), correction: bool = True, **keys) -> GrpoSection:
    return section_of(generation={"engine": "workers", "importance_sampling_correction": correction,
                                  "importance_sampling_mode": mode, "importance_sampling_clip_min": clip[0],
                                  "importance_sampling_clip_max": clip[1]}, **keys)


def kept_round(section: GrpoSection, acted: bool, same: bool = False):
    """(a round's entries as a round from an engine beside the trainer keeps them: per completion, the trainer's
    ``old_logps`` and the sampler's ``sampler_logps`` at its labelled tokens; TRL's tensors of the same completions:
    the completion mask, truncated completions zeroed as its mask_truncated_completions zeroes them, the tool mask,
    None unless ``acted``, the old and the sampler's log-probs, ``[micro, rows, tokens]``). The sampler's log-probs
    are the old ones plus noise, one labelled token NaN (unscored) and one completion's 1.2 below, or the old ones
    (``same``). ``acted``: rollouts
    with tool results (unlabelled) and, with ``mask_truncated_completions``, completions cut at MAX_NEW."""
    mask, _, old, *_ = fixed_inputs()
    g = torch.Generator().manual_seed(5)
    sampler = old.clone() if same else old + 0.25 * torch.randn(old.shape, generator=g)
    ids = torch.randint(10, 50, (MICRO, ROWS, MAX_NEW), generator=g)
    tool = torch.rand(old.shape, generator=g) > 0.3 if acted else torch.ones_like(mask)
    if not same:  # a token the sampler did not score; a completion it found far less likely (TRL's bound 3 binds)
        sampler[0, 1, 0], tool[0, 1, 0] = float("nan"), True
        sampler[1, 0], tool[1, 0, :2] = old[1, 0] - 1.2, True
    completion_masks, entries = [], []
    for m in range(MICRO):
        completions = [ids[m, r, :int(mask[m, r].sum())].tolist() for r in range(ROWS)]
        for r, c in enumerate(completions):
            c[-1] = TRUNCATED if acted and len(c) == MAX_NEW and (m + r) % 2 == 0 else EOS
        cut = torch.tensor([c[-1] == TRUNCATED for c in completions]) & section.mask_truncated_completions
        completion_masks.append(mask[m] & ~cut[:, None])
        labelled = completion_masks[-1] & tool[m]
        entries.append({"prompt_ids": [[5, 6]] * ROWS, "completion_ids": completions,
                        "old_logps": per_row(old[m], labelled), "sampler_logps": per_row(sampler[m], labelled),
                        **({"tool_masks": [tool[m, r, :len(c)].int().tolist() for r, c in enumerate(completions)]}
                           if acted else {})})
    return entries, (torch.stack(completion_masks), tool.int() if acted else None, old, sampler)


def hfsdp_round_loss(section: GrpoSection, entries):
    """hfsdp's loss of the round's micro-batches (GRPO._batch of its entries, the kept log-probs spread over the
    labelled tokens), each as GRPO.loss computes it from the fixed log-probs, divided by the global batch's units;
    and the gradient wrt the log-probs."""
    _, logps, _, ref, adv, _ = fixed_inputs()
    objective = GRPO(section, [], None, SimpleNamespace(eos_token_id=EOS))
    objective.unwrapped = _Model()
    batches = [objective._batch({**entry, "advantages": adv[m].tolist()}, PAD, "cpu", select_logits=True)
               for m, entry in enumerate(entries)]
    units = sum(batch.num_targets for batch in batches)
    leaf = logps.clone().requires_grad_(True)
    total = 0.0
    for m, batch in enumerate(batches):
        part, _ = token_loss(leaf[m], batch.old_logps, batch.advantages, ref[m] if section.beta else None,
                             batch.sequence_targets != IGNORE_INDEX, section, MAX_NEW, None, batch.sampler_logps)
        total = total + part / units
    total.backward()
    return total.detach(), leaf.grad


def trl_round_loss(section: GrpoSection, trl_tensors):
    """TRL's loss of the same round: the ratio from its own lines over the generation batch, then _compute_loss of
    each micro-batch with the old log-probs (TRL computes them whenever it corrects) and the sampler's."""
    completion_mask, tool_mask, old, sampler = trl_tensors
    _, logps, _, ref, adv, entropies = fixed_inputs()
    extra = {"old_per_token_logps": old, "sampling_per_token_logps": sampler}
    if section.generation.importance_sampling_correction:
        flat = [t.flatten(0, 1) if t is not None else None for t in trl_tensors]
        ratio, _ = trl_sampling(section, flat[2], flat[3], flat[0].int(), flat[1])
        extra["importance_sampling_ratio"] = ratio.view(MICRO, ROWS, -1)
    if tool_mask is not None:
        extra["tool_mask"] = tool_mask
    return trl_loss(section, 1, completion_mask, logps, old, ref, adv, entropies, extra)


def assert_round_is_trls(section: GrpoSection, acted: bool) -> float:
    entries, trl_tensors = kept_round(section, acted)
    ours, our_grad = hfsdp_round_loss(section, entries)
    theirs, their_grad = trl_round_loss(section, trl_tensors)
    assert float(ours) == pytest.approx(theirs, rel=REL, abs=1e-8), (float(ours), theirs)
    assert torch.allclose(our_grad, their_grad, rtol=REL, atol=1e-8), (our_grad - their_grad).abs().max()
    assert our_grad.abs().sum() > 0
    return float(ours)


@pytest.mark.parametrize("acted", [False, True], ids=["plain", "tools-and-truncated"])
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"clip={c[0]}-{c[1]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_corrected_loss_and_its_gradient_are_trls(loss_type, mode, clip, acted):
    """Every importance_sampling_mode and clip bounds, with the KL term (which TRL leaves uncorrected), on completions
    with and without tool results and truncated completions: TRL's loss given its own ratio; and not the loss
    uncorrected (the correction acted). vespo takes token modes only (as TRL, the schema refuses the others)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        with pytest.raises(ValueError, match="token_truncate or token_mask"):
            beside(mode, clip, loss_type=loss_type)
        return
    keys = {"loss_type": loss_type, "beta": 0.04, "mask_truncated_completions": acted}
    section = beside(mode, clip, **keys)
    corrected = assert_round_is_trls(section, acted)
    uncorrected = assert_round_is_trls(beside(mode, clip, correction=False, **keys), acted)
    assert corrected != pytest.approx(uncorrected, rel=1e-4)
    old, sampler, mask = round_logps(kept_round(section, acted)[0])
    unbounded = beside(mode.replace("mask", "truncate"), (None, None)).generation
    assert not torch.allclose(importance_sampling_ratio(old, sampler, mask, section.generation),
                              importance_sampling_ratio(old, sampler, mask, unbounded))  # the bounds bound


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_off_policy_mask_reads_the_samplers_log_probs_as_trls(loss_type, correction):
    """With an engine beside the trainer, TRL's off-policy mask compares the sampler's log-probs (vLLM's) with the
    current ones, corrected or not (the threshold drops a completion by the sampler's, not by the old ones)."""
    mode = "token_truncate" if loss_type == "vespo" else "sequence_mask"
    assert_round_is_trls(beside(mode, correction=correction, loss_type=loss_type, beta=0.04,
                                off_policy_mask_threshold=0.5), acted=True)


@pytest.mark.parametrize("acted", [False, True], ids=["plain", "tools-and-truncated"])
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"clip={c[0]}-{c[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_the_rounds_sampling_metrics_are_trls_on_one_process(mode, clip, acted):
    """The round's sampling/sampling_logp_difference and sampling/importance_sampling_ratio metrics are TRL's
    (its own lines, one process, the round as its generation batch), a NaN sampler log-prob left out of the
    difference; with the correction off the difference alone is reported."""
    section = beside(mode, clip, mask_truncated_completions=acted)
    entries, (completion_mask, tool_mask, old, sampler) = kept_round(section, acted)
    flat = [t.flatten(0, 1) if t is not None else None for t in (completion_mask, tool_mask, old, sampler)]
    _, theirs = trl_sampling(section, flat[2], flat[3], flat[0].int(), flat[1])
    objective = GRPO(section, [], None, None)
    ours = objective.round_stats(torch.zeros(MICRO * ROWS, 0), entries)
    assert set(theirs) <= set(ours) and len(theirs) == 5
    assert all(ours[k] == pytest.approx(v, rel=REL, abs=1e-8) for k, v in theirs.items()), (ours, theirs)
    assert theirs["sampling/sampling_logp_difference/mean"] > 0
    off = GRPO(beside(mode, clip, correction=False), [], None, None).round_stats(torch.zeros(MICRO * ROWS, 0), entries)
    assert {k for k in off if k.startswith("sampling/")} == {k for k in theirs if "difference" in k}
    assert all(off[k] == ours[k] for k in off if k.startswith("sampling/"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_sampler_that_agrees_exactly_gives_ratios_of_1_and_the_uncorrected_loss_bit_for_bit(loss_type, mode):
    """sampler_logps == old_logps: every ratio is exactly 1, the mismatch exactly 0, and the loss and its gradient
    are bit for bit those of the same round trained inline (no sampler's log-probs, no correction)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        return  # refused (test_the_corrected_loss_and_its_gradient_are_trls)
    keys = {"loss_type": loss_type, "beta": 0.04, "mask_truncated_completions": True, "off_policy_mask_threshold": 0.05}
    section = beside(mode, **keys)
    entries, _ = kept_round(section, acted=True, same=True)
    old, sampler, mask = round_logps(entries)
    ratio = importance_sampling_ratio(old, sampler, mask, section.generation)
    assert torch.equal(ratio, torch.ones_like(ratio))
    stats = GRPO(section, [], None, None).round_stats(torch.zeros(MICRO * ROWS, 0), entries)
    assert {k: v for k, v in stats.items() if k.startswith("sampling/")} == {
        "sampling/sampling_logp_difference/mean": 0.0, "sampling/sampling_logp_difference/max": 0.0,
        "sampling/importance_sampling_ratio/min": 1.0, "sampling/importance_sampling_ratio/mean": 1.0,
        "sampling/importance_sampling_ratio/max": 1.0}
    corrected, corrected_grad = hfsdp_round_loss(section, entries)
    inline, inline_grad = hfsdp_round_loss(section_of(**keys), [{k: v for k, v in e.items() if k != "sampler_logps"}
                                                                for e in entries])
    assert torch.equal(corrected, inline) and torch.equal(corrected_grad, inline_grad)


def test_a_round_keeps_the_trainers_log_probs_when_an_engine_samples_beside_it():
    """For the mismatch and the correction: every online objective (RLOO's loss has no correction, as TRL's)."""
    from hfsdp.builtin.rloo import RlooSection
    from hfsdp.builtin.rloo.loss import RLOO

    assert not GRPO(section_of(), [], None, None).keeps_old_logps()
    assert GRPO(beside(), [], None, None).keeps_old_logps()
    assert GRPO(beside(correction=False), [], None, None).keeps_old_logps()
    rloo = RlooSection(rewards=[{"name": "json_fields"}], beta=0.0, generation={"engine": "workers"})
    assert RLOO(rloo, [], None, None).keeps_old_logps()
    assert not RLOO(rloo.model_copy(update={"generation": section_of().generation}), [], None, None).keeps_old_logps()
