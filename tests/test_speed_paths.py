"""The fast paths of issue 14 keep every guarantee: one process runs without a wrapper and computes what FSDP on one
rank computes; micro-batches without padding go without an attention mask; grouping rows by length keeps the global
batches a function of (seed, step) alone, whatever the split over ranks and micro-batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import read_metrics, run_cli, tiny_config
from hfsdp.data import batches


def _plan(lengths, per_device, world, accumulation, seed=3, grouped=True):
    return batches.BatchPlan(len(lengths), per_device, world, accumulation, seed, lengths=lengths if grouped else None)


def _global_batches(plan, steps):
    return [sorted(i for m in range(plan.accumulation) for r in range(plan.world_size) for i in plan.rows(s, m, r))
            for s in range(steps)]


def _padding(plan, lengths, steps):
    padded = real = 0
    for s in range(steps):
        for m in range(plan.accumulation):
            for r in range(plan.world_size):
                rows = [lengths[i] for i in plan.rows(s, m, r)]
                padded += max(rows) * len(rows)
                real += sum(rows)
    return 1 - real / padded


def test_grouping_by_length_keeps_global_batches_whatever_the_split():
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(1003)]  # not a multiple of the global batch: epochs straddle
    steps = 3 * len(lengths) // 16  # three epochs of global batches of 16 rows
    one = _plan(lengths, 16, 1, 1)
    reference = _global_batches(one, steps)
    for per_device, world, accumulation in ((8, 2, 1), (2, 4, 2), (1, 2, 8)):
        assert _global_batches(_plan(lengths, per_device, world, accumulation), steps) == reference
    assert _global_batches(_plan(lengths, 16, 1, 1), steps) == reference  # a pure function of (seed, step)
    # every epoch still visits every row exactly once
    stream = [i for s in range(steps) for i in one.rows(s, 0, 0)]
    for epoch in range(2):
        assert sorted(stream[epoch * len(lengths):(epoch + 1) * len(lengths)]) == list(range(len(lengths)))
    # and the micro-batches pad far less than in the plain seeded order
    split = (4, 2, 2)
    grouped, plain = _plan(lengths, *split), _plan(lengths, *split, grouped=False)
    assert _padding(grouped, lengths, steps) < 0.25 * _padding(plain, lengths, steps)
    assert batches.padding_fraction(lengths, 4, 3, grouped=True) < 0.25 * batches.padding_fraction(lengths, 4, 3)


def test_micro_batches_without_padding_have_no_attention_mask():
    same = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [4, 5, 6]}]
    batch = batches.micro_batch(same, pad_id=0, device="cpu")
    assert set(batch.inputs) == {"input_ids", "use_cache"} and batch.inputs["use_cache"] is False  # no KV cache
    assert (batch.tokens, batch.num_targets) == (6, 4)
    assert batch.targets.tolist() == [[2, 3, -100], [5, 6, -100]]  # the label of the token after each position
    ragged = batches.micro_batch(same[:1] + [{"input_ids": [7], "labels": [7]}], pad_id=0, device="cpu")
    assert ragged.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (ragged.tokens, ragged.num_targets) == (4, 2)


def test_logits_only_where_a_row_has_a_label():
    prompt_then_answer = [{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, -100, -100, 5, 6]},
                          {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, -100, 4, 5]}]
    batch = batches.micro_batch(prompt_then_answer, pad_id=0, device="cpu", select_logits=True)
    assert batch.inputs["logits_to_keep"].tolist() == [2, 3, 4]  # positions 0, 1 and 5 predict no label
    assert batch.targets.tolist() == [[-100, 5, 6], [4, 5, -100]]
    assert batch.num_targets == 4
    every_position = batches.micro_batch([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], 0, "cpu", select_logits=True)
    assert every_position.inputs["logits_to_keep"].tolist() == [0, 1] and every_position.targets.tolist() == [[2, 3]]
    nothing = batches.micro_batch([{"input_ids": [1, 2], "labels": [-100, -100]}], 0, "cpu", select_logits=True)
    assert nothing.inputs["logits_to_keep"].tolist() == [0] and nothing.targets.tolist() == [[-100]]


def test_fast_paths_compute_the_same_loss(tiny_model_dir):
    """No mask where a mask of ones would be, and logits only at labelled positions: the same summed loss."""
    from transformers import AutoModelForCausalLM

    from hfsdp.model import loading
    from hfsdp.model.token_loss import token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert loading.accepts_logits_to_keep(model)
    rows = [{"input_ids": list(range(10, 30)), "labels": [-100] * 12 + list(range(22, 30))},
            {"input_ids": list(range(40, 60)), "labels": [-100] * 15 + list(range(55, 60))}]
    with torch.no_grad():
        plain = batches.micro_batch(rows, pad_id=0, device="cpu")
        reference = token_loss_sum(model, plain)
        plain.inputs["attention_mask"] = torch.ones_like(plain.inputs["input_ids"])
        torch.testing.assert_close(token_loss_sum(model, plain), reference)
        selected = batches.micro_batch(rows, pad_id=0, device="cpu", select_logits=True)
        assert selected.inputs["logits_to_keep"].numel() == 8
        torch.testing.assert_close(token_loss_sum(model, selected), reference)
        ragged = rows[:1] + [{"input_ids": list(range(40, 52)), "labels": [-100] * 9 + [49, 50, 51]}]
        torch.testing.assert_close(token_loss_sum(model, batches.micro_batch(ragged, 0, "cpu", select_logits=True)),
                                   token_loss_sum(model, batches.micro_batch(ragged, 0, "cpu")))


def test_what_wraps_the_model():
    from hfsdp.config.schema import FSDPConfig, ParallelConfig
    from hfsdp.layout.degrees import ParallelDims

    def wrapper(fsdp: FSDPConfig, world_size: int) -> str:  # the degrees' answer, one node
        return ParallelDims.of(fsdp, ParallelConfig(), world_size, world_size).wrapper

    assert wrapper(FSDPConfig(), 1) == "none"  # one process: nothing to shard, no wrapper
    assert wrapper(FSDPConfig(), 2) == "fsdp2"
    assert wrapper(FSDPConfig(single_process="fsdp"), 1) == "fsdp2"  # asked for explicitly
    assert wrapper(FSDPConfig(cpu_offload=True), 1) == "fsdp2"  # only FSDP offloads
    assert wrapper(FSDPConfig(version=1, sharding_strategy="NO_SHARD"), 2) == "fsdp1"
    assert wrapper(FSDPConfig(sharding_strategy="NO_SHARD"), 2) == "ddp"  # FSDP2 NO_SHARD runs as DDP
    assert wrapper(FSDPConfig(sharding_strategy="NO_SHARD", single_process="fsdp"), 1) == "none"


@pytest.mark.slow
def test_one_process_runs_unwrapped_and_matches_fsdp_on_one_rank(tmp_path):
    """The default one-process run has no wrapper, says so, and trains exactly the steps FSDP on one rank trains;
    without clipping the grad norm is still reported, the same as FSDP's."""
    runs = {}
    for name, single in (("plain", "auto"), ("fsdp", "fsdp")):
        folder = tmp_path / name
        folder.mkdir()
        config = tiny_config(folder, fsdp={"single_process": single},
                             train={"max_steps": 3, "max_grad_norm": None, "eval_at_start": False,
                                    "export_final": False})
        proc = run_cli("train", str(config))
        runs[name] = (proc, folder / "run")
    plain_proc, plain = runs["plain"]
    report = json.loads((plain / "startup_rank0.json").read_text())
    assert report["distributed_type"] == "NO" and report["wrapped_units"] == 0
    assert "one process: runs without a wrapper" in plain_proc.stdout
    fsdp_report = json.loads((runs["fsdp"][1] / "startup_rank0.json").read_text())
    assert fsdp_report["distributed_type"] == "FSDP" and fsdp_report["wrapped_units"] > 1
    a = {m["step"]: m for m in read_metrics(plain) if "loss" in m}
    b = {m["step"]: m for m in read_metrics(runs["fsdp"][1]) if "loss" in m}
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-5)
        assert a[step]["grad_norm"] == pytest.approx(b[step]["grad_norm"], rel=1e-4) and a[step]["grad_norm"] > 0


def test_the_gradient_norm_is_the_same_from_any_row_shards_and_near_a_float64_sum():
    """``sum_of_squares`` (issue 36: the clip at torch's float32 speed): a matrix's rows are summed in float32 and
    their squares in float64, so FSDP2's row shards give the same terms as the whole matrix (bit for bit), and the
    norm is within 1e-9 of an all-float64 sum where torch's float32 norm of a 28M-element tensor is not."""
    from hfsdp.parallel.world import sum_of_squares

    torch.manual_seed(0)
    g = torch.randn(49152, 576) * 1e-3  # SmolLM2-135M's embedding (and tied head) gradient's shape
    whole = sum_of_squares(g)
    assert whole.dtype == torch.float64
    for cut in (1, 7, 24576, 24577):  # the rows' terms are the same; only the float64 sum's order differs
        parts = sum_of_squares(g[:cut]) + sum_of_squares(g[cut:])
        assert float(parts.sqrt().float()) == float(whole.sqrt().float()), cut
        assert abs(float(parts) / float(whole) - 1) < 1e-14, cut
    exact = torch.linalg.vector_norm(g, dtype=torch.float64)
    assert abs(float(whole.sqrt()) / float(exact) - 1) < 1e-9
    flat = g.view(-1)[:1000]
    assert torch.equal(sum_of_squares(flat), torch.linalg.vector_norm(flat, dtype=torch.float64).square())
    half = g[:64].bfloat16()  # other dtypes: their rows' norms in float32
    assert abs(float(sum_of_squares(half)) / float(half.double().square().sum()) - 1) < 1e-6
