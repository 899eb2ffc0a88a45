"""Context parallelism (``parallel.cp_size``, ring attention, issue 73): the ranks of a ring train on the same rows,
each on its share of every row's positions in order, and attend over the other shares' keys and values as they pass
around the ring; the heads need not divide by anything. The claims, on the SmolLM2 architecture with the real
SmolLM2-135M's heads (9 heads, 3 KV heads: sp 2 is refused on it) shrunk to 2 layers of width 144, on rows of up to
3,072 tokens (bundled ShareGPT chats laid end to end, 2,000 and more tokens each):

* cp 2 on 2 ranks computes the steps, evals and exported weights of one process on the same global batch (float32
  sums of other orders apart: within 1e-5), also with packed rows and with LoRA; sp 2 x cp 2 on 4 ranks likewise on
  the tiny model, whose 4 heads and 2 KV heads allow sp 2 (Ulysses inside each pair, the ring across the pairs);
* a cp 2 checkpoint resumes bit for bit on cp 2;
* the ring's pieces: its attention and gradients equal sdpa's over whole rows, causal and with packed sequences,
  with 9 heads over 3 KV heads, on rings of 2, 3 and 4 threads.

The cp 2 cells of the smoke, resume and pairs matrices are in tests/test_combinations.py (option ``cp2``).
"""

from __future__ import annotations

import types

import pytest

from conftest import _tiny_variant
from test_combinations import _merge, exported, losses, read_metrics, resume, startup
from test_sequence_parallel import (TRAIN, assert_computes_what_one_process_computes,
                                    assert_split_rows_compute_what_one_process_computes, long_chats)


def nine_heads() -> str:
    """The SmolLM2 architecture with SmolLM2-135M's heads (9, and 3 KV heads) at head width 16, 2 layers, randomly
    initialised (seed 0), with the real tokenizer."""
    return str(_tiny_variant("smollm2-tiny-9heads-seed0", 0, num_attention_heads=9, num_key_value_heads=3,
                             hidden_size=144))


VARIANTS = {
    "base": {},
    "packing": {"plugins": ["packing"], "packing": {"max_len": 6144}},  # 2 chats a row, from the dataset transform
    "lora": {"plugins": ["lora"]},
}


def sections(variant: str, cp: int, sp: int = 1, model: str | None = None) -> dict:
    data = {"format": "chat", **long_chats(7600, "longer-chats-v1"), "max_seq_len": 3072, "max_eval_samples": 4}
    parts = {"model": {"name_or_path": model or nine_heads()}, "data": data, "train": TRAIN,
             "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD", "single_process": "fsdp"}}
    degrees = {key: size for key, size in (("cp_size", cp), ("sp_size", sp)) if size > 1}
    return _merge(parts, VARIANTS[variant], {"parallel": degrees} if degrees else {})


@pytest.fixture(scope="module")
def runs(run_registry):
    return run_registry


def one_process(runs, variant: str, model: str | None = None):
    return runs.run(f"cp-{variant}-x1{'-' + model if model else ''}", 1, sections(variant, 1, model=model))


def cp2(runs, variant: str):
    return runs.run(f"cp-{variant}-x2-cp2", 2, sections(variant, 2))


# CI runs the base rows; packed rows (CI: the pair packing+cp2 in tests/test_combinations.py) and LoRA with
# --full-matrix
@pytest.mark.slow
@pytest.mark.parametrize("variant", [v if v == "base" else pytest.param(v, marks=pytest.mark.full_matrix)
                                     for v in VARIANTS])
def test_cp2_on_two_ranks_computes_what_one_process_computes_with_nine_heads(runs, variant):
    run, proc = cp2(runs, variant)
    one, _ = one_process(runs, variant)
    assert_split_rows_compute_what_one_process_computes(run, proc, one, "cp_size", "context parallel 2", 2048)
    assert max(m["tokens"] for m in read_metrics(run) if "loss" in m) >= 2 * 3072  # 2 rows of 3,072 tokens
    if variant == "packing":
        assert "16 samples packed into 8 rows" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.full_matrix
def test_sp2_x_cp2_on_four_ranks_computes_what_one_process_computes(runs):
    """Ulysses inside each pair of ranks (the tiny model's 4 heads and 2 KV heads allow sp 2), the ring across the
    two pairs."""
    run, _ = runs.run("cp-base-x4-sp2-cp2-tiny", 4, sections("base", 2, 2, model="smollm2-tiny"))
    one, _ = one_process(runs, "base", model="smollm2-tiny")
    assert_computes_what_one_process_computes(run, one)
    report = startup(run)
    assert "over dp 1 x context parallel 2 x sequence parallel 2" in report["strategy"], report


@pytest.mark.slow
@pytest.mark.full_matrix  # (CI resumes the ring as the pair packing+cp2 in tests/test_combinations.py)
def test_cp2_resumes_exactly(runs, tmp_path):
    import json

    import torch

    run, _ = cp2(runs, "base")
    assert json.loads((run / "checkpoints" / "step-2" / "hfsdp_checkpoint.json").read_text())["cp_size"] == 2
    resumed = resume(tmp_path, run, 2)
    a, b = losses(resumed), losses(run)
    assert sorted(a) == [3, 4] and all(a[s] == b[s] for s in a), (a, b)  # loss and grad norm, bit for bit
    got, want = exported(resumed)["model.safetensors"], exported(run)["model.safetensors"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_ring_computes_sdpa_over_whole_rows_and_its_gradients(cp):
    """Threads as the ranks of a ring: each holds its share of q, k, v (9 heads over 3 KV heads, 2 rows of 24
    positions); the ring's attention equals transformers' sdpa over the whole rows, causal, and with packed sequences
    each on its own (the rows' padding after them is unlabelled: nothing reads it); so do the gradients that reach
    each rank's q, k and v."""
    assert_ring_computes_sdpa(cp, "cpu")


def assert_ring_computes_sdpa(cp: int, device: str) -> None:
    """:func:`test_the_ring_computes_sdpa_over_whole_rows_and_its_gradients` with the tensors on ``device``."""
    import torch
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hfsdp.model.packed_attention import sequence_sdpa
    from hfsdp.parallel.ring import Ring, ring_attention
    from threaded_ranks import on_threads

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=3, training=False)
    g = torch.Generator().manual_seed(cp)
    width, share = 24, 24 // cp
    q, k, v = (torch.randn(2, heads, width, 8, generator=g).to(device) for heads in (9, 3, 3))
    for segments, real in ((None, (24, 24)), ([[(0, 5), (5, 17)], [(0, 20)]], (17, 20))):
        weights = torch.randn(2, width, 9, 8, generator=g)
        for row, used in enumerate(real):
            weights[row, used:] = 0  # the padding after a row's sequences: no labelled position reads it
        weights = weights.to(device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kwargs = {"packed_segments": segments} if segments else {}
        out, _ = (sequence_sdpa if segments else sdpa_attention_forward)(module, *leaves, None, scaling=0.3, **kwargs)
        (out * weights).sum().backward()
        want, want_grads = out.detach(), [t.grad for t in leaves]

        def rank(r):
            part = slice(share * r, share * (r + 1))
            leaves = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(module, *leaves, Ring(dist.group.WORLD, cp, r), segments, scaling=0.3)
            (out * weights[:, part]).sum().backward()
            return out.detach(), [t.grad for t in leaves]

        got = on_threads(cp, rank)
        out = torch.cat([o for o, _ in got], dim=1)
        for row, used in enumerate(real):
            assert torch.allclose(out[row, :used], want[row, :used], atol=1e-5)
        for i in range(3):
            assert torch.allclose(torch.cat([grads[i] for _, grads in got], dim=2), want_grads[i], atol=1e-5)


def test_a_ring_of_sequence_parallel_groups_holds_each_rows_shares_in_order():
    """8 ranks at cp 2 x sp 2: 2 data-parallel ranks of 4; in each, ranks 0-1 (a sequence-parallel group) hold the
    row's first two quarters and ranks 2-3 the last two, each group a ring member; FSDP shards over all 8; the groups
    must divide the world."""
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.layout.degrees import World

    config = HfsdpConfig.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x"},
                                         "train": {"output_dir": "x", "max_steps": 1},
                                         "parallel": {"cp_size": 2, "sp_size": 2}})
    dims = World(rank=0, size=8, local_size=8, on_cpu=True).with_dims(config).dims
    assert (dims.dp_size, dims.token_split, dims.shard_group, dims.gradient_ranks) == (2, 4, 8, 8)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.token_share(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert [dims.cp_rank(r) for r in range(8)] == [0, 0, 1, 1] * 2
    assert [dims.sp_rank(r) for r in range(8)] == [0, 1] * 4
    assert dims.mesh_dims == ("dp_replicate", "dp_shard", "cp", "sp", "tp") and dims.problems(config) == []
    small = World(rank=0, size=6, local_size=6, on_cpu=True).with_dims(config).dims
    assert small.problems(config) == [("parallel.cp_size", "cp_size 2 x sp_size 2 is 4 ranks a group, which does "
                                                           "not divide the world size 6: launch a multiple of 4 "
                                                           "processes, or change them")]


@pytest.mark.slow
@pytest.mark.full_matrix  # (CI checks the same script's sequence-parallel rows: tests/test_sequence_parallel.py)
def test_cp2_keeps_about_half_the_activations_per_rank_and_the_plan_predicts_them(tmp_path):
    """``benchmarks/sequence_parallel.py --cp 1,2`` shrunk (the tiny model, rows of 2,048 tokens, 2 gloo ranks): the
    bytes autograd keeps for backward per rank at cp 2 are at most 0.6 of cp 1's, and ``hfsdp plan --cp`` predicts
    each within 10 %. Memory, not time: the same on a busy machine."""
    import json
    import subprocess
    import sys

    from conftest import REPO, base_env

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sequence_parallel.py"), "--out", str(tmp_path),
                           "--model", "smollm2-tiny", "--seq-len", "2048", "--steps", "1", "--sp", "1", "--cp", "1,2",
                           "--device-memory", "2GiB"], capture_output=True, text=True, env=base_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    one, two = json.loads((tmp_path / "sequence_parallel.json").read_text())
    assert (one["cp"], two["cp"]) == (1, 2) and one["tokens_per_step"] == 2 * two["tokens_per_step"] == 2 * 2048
    assert two["measured"] <= 0.6 * one["measured"], (one, two)
    for row in (one, two):
        assert 0.9 <= row["planned"] / row["measured"] <= 1.1, row
    assert two["ring_bytes"] > 0 == one["ring_bytes"] and two["all_to_all_bytes"] == 0
    assert two["longest_row"] > one["longest_row"], (one, two)
