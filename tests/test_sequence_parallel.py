"""Sequence parallelism (``parallel.sp_size``, issue 54): each rank of a sequence-parallel group trains on its share
of every row's positions, attention exchanges positions for heads (DeepSpeed-Ulysses), FSDP2 shards over every
rank. The claims, on the tiny model's real architecture with rows of 1,371 to 1,536 tokens:

* sp 2 on 2 ranks and sp 2 x dp 2 on 4 ranks compute the steps, evals and weights of one process on the same global
  batch (float32 sums of other orders apart: losses, gradient norms and eval losses within 1e-5, exported weights
  within 1e-5), also with LoRA and with packed rows (packed by the dataset transform or per micro-batch);
* an sp 2 checkpoint resumes bit for bit on sp 2, and on one process within float32 sums of other orders;
* what sequence parallelism cannot combine with is refused before any weight loads, naming the key;
* the pieces: a row's split keeps the whole row's shifted targets and positions, and the exchange around attention
  computes sdpa over whole rows (threads as ranks).

The sp 2 cells of the smoke, resume and pairs matrices are in tests/test_combinations.py (option ``sp2``).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from conftest import CACHE_DIR, RUN_ENV, run_cli, run_torchrun, sharegpt_rows
from hfsdp.config.schema import HfsdpConfig
from hfsdp.rules import parallel
from test_combinations import _merge, exported, losses, read_metrics, resume, resume_from, startup

STEPS = 4


def long_chats(chars: int = 3700, name: str = "long-chats-v1") -> dict[str, str]:
    """Train and eval files of long chats (16 and 8 rows of at least ``chars`` characters, 1,371 to 1,977 tokens
    under SmolLM2's template at the default: the bundled ShareGPT chats laid end to end, every turn kept), written
    once into the test cache as ``name``."""
    folder = CACHE_DIR / name
    files = {"path": folder / "train.jsonl", "eval_path": folder / "eval.jsonl"}
    if not files["eval_path"].is_file():
        chats, source, n = [], sharegpt_rows(), 0
        for k in range(24):
            turns: list[dict] = []
            while sum(len(t["value"]) for t in turns) < chars + 170 * (k % 7):
                turns += source[n % len(source)]["conversations"]
                n += 1
            chats.append(json.dumps({"conversations": turns}))
        folder.mkdir(parents=True, exist_ok=True)
        for key, rows in (("path", chats[:16]), ("eval_path", chats[16:])):
            tmp = files[key].with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text("\n".join(rows) + "\n")
            tmp.rename(files[key])
    return {key: str(path) for key, path in files.items()}


# lr 1e-3: Adam moves a weight whose gradient is near 0 by up to a step for float32 noise in it; at the matrices'
# 3e-3, sp 2 ended 1.1e-5 from one process (a weight the split got wrong would be a step or more apart)
TRAIN = {"max_steps": STEPS, "save_every": 2, "lr_scheduler": "constant", "weight_decay": 0.1, "learning_rate": 1e-3,
         "eval_at_start": True, "per_device_batch_size": 2, "collective_timeout_s": 120}
VARIANTS = {
    "base": {},
    "lora": {"plugins": ["lora"]},
    "packing": {"plugins": ["packing"], "packing": {"max_len": 3072}},  # 2 chats a row, from the dataset transform
    "micro_batch_packing": {"plugins": ["packing"], "packing": {"scope": "micro_batch"}},  # spans from the packer
}


def sections(variant: str, sp: int, **more) -> dict:
    data = {"format": "chat", **long_chats(), "max_seq_len": 1536, "max_eval_samples": 8}
    parts = {"data": data, "train": TRAIN, "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD",
                                                   "single_process": "fsdp"}}
    return _merge(parts, VARIANTS[variant], {"parallel": {"sp_size": sp}} if sp > 1 else {}, more)


@pytest.fixture(scope="module")
def runs(run_registry):
    return run_registry


def one_process(runs, variant: str):
    return runs.run(f"sp-{variant}-x1", 1, sections(variant, 1))


def sp2(runs, variant: str):
    return runs.run(f"sp-{variant}-x2-sp2", 2, sections(variant, 2))


def four_ranks(runs):
    return runs.run("sp-base-x4-sp2-dp2", 4, sections("base", 2, train={"per_device_batch_size": 1}))


def assert_computes_what_one_process_computes(run: Path, one: Path) -> None:
    import torch

    a, b = read_metrics(run), read_metrics(one)
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    compared = 0
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "eval_loss", "tokens"):
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=1e-5), (key, x, y)
                compared += 1
    assert compared >= 3 * STEPS + 2  # and the evals before and after
    got, want = exported(run), exported(one)
    assert got.keys() == want.keys()
    for name in want:
        for key, tensor in want[name].items():
            assert torch.allclose(got[name][key], tensor, rtol=0, atol=1e-5), (key, (got[name][key] - tensor).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.full_matrix) if v in ("lora", "micro_batch_packing")
                                     else v for v in VARIANTS])
def test_sp2_on_two_ranks_computes_what_one_process_computes(runs, variant):
    run, proc = sp2(runs, variant)
    one, _ = one_process(runs, variant)
    assert_split_rows_compute_what_one_process_computes(run, proc, one, "sp_size", "sequence parallel 2", 1024)
    if variant == "packing":
        assert "16 samples packed into 8 rows" in proc.stdout + proc.stderr


def assert_split_rows_compute_what_one_process_computes(run: Path, proc, one: Path, key: str, said: str,
                                                        shortest: int) -> None:
    """``run`` (2 ranks splitting each row: ``parallel.<key>`` 2, its startup strategy saying ``said``) computes what
    ``one`` (one process) computes, FSDP2 shards over both ranks, and its 2 rows a step have at least ``shortest``
    tokens each."""
    assert_computes_what_one_process_computes(run, one)
    report = startup(run)
    assert report[key] == 2 and f"over dp 1 x {said}" in report["strategy"], report
    assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"], report  # FSDP2 over both
    lengths = [m["tokens"] for m in read_metrics(run) if "loss" in m]
    assert min(lengths) >= 2 * shortest, lengths


@pytest.mark.slow
def test_sp2_with_weights_loaded_by_rank_0_alone_computes_what_one_process_computes(runs):
    """``fsdp.cpu_ram_efficient_loading``: rank 0 reads the weights, the other rank receives its shards."""
    run, _ = runs.run("sp-base-x2-sp2-ram-efficient", 2, sections("base", 2, fsdp={"cpu_ram_efficient_loading": True}))
    one, _ = one_process(runs, "base")
    assert_computes_what_one_process_computes(run, one)


@pytest.mark.slow
def test_sp2_under_fsdp1_computes_what_one_process_computes(runs):
    """FSDP1's flat parameters, sharded over both ranks of the group, against the one-process FSDP2 run."""
    run, _ = runs.run("sp-base-x2-sp2-fsdp1", 2, sections("base", 2, fsdp={"version": 1}))
    one, _ = one_process(runs, "base")
    assert_computes_what_one_process_computes(run, one)
    report = startup(run)
    assert report["fsdp_version"] == 1 and report["strategy"] == "FULL_SHARD over dp 1 x sequence parallel 2", report


@pytest.mark.slow
def test_sp2_x_dp2_on_four_ranks_computes_what_one_process_computes(runs):
    run, _ = four_ranks(runs)
    one, _ = one_process(runs, "base")
    assert_computes_what_one_process_computes(run, one)
    assert "over dp 2 x sequence parallel 2" in startup(run)["strategy"]
    assert json.loads((run / "checkpoints" / "step-2" / "hfsdp_checkpoint.json").read_text())["sp_size"] == 2


@pytest.mark.slow
def test_sp2_resumes_exactly(runs, tmp_path):
    import torch

    run, _ = sp2(runs, "base")
    resumed = resume(tmp_path, run, 2)
    a, b = losses(resumed), losses(run)
    assert sorted(a) == [3, 4] and all(a[s] == b[s] for s in a), (a, b)  # loss and grad norm, bit for bit
    got, want = exported(resumed)["model.safetensors"], exported(run)["model.safetensors"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_an_sp2_checkpoint_resumes_on_one_process_as_one_process_trains(runs, tmp_path):
    """The weights and optimizer state are sharded as without sequence parallelism: one process resumes the sp 2
    checkpoint of step 2 and trains steps 3 and 4 as the one-process run (float32 sums of other orders apart)."""
    run, _ = sp2(runs, "base")
    one, _ = one_process(runs, "base")
    resumed = resume_from(tmp_path, run, 1, step=2, changes={"parallel": {"sp_size": 1}})
    a, b = losses(resumed), losses(one)
    assert sorted(a) == [3, 4]
    for step in (3, 4):
        assert a[step] == pytest.approx(b[step], rel=1e-5), (step, a, b)


@pytest.mark.slow
def test_sp2_keeps_about_half_the_activations_per_rank_and_the_plan_predicts_them(tmp_path):
    """``benchmarks/sequence_parallel.py`` shrunk (the tiny model, rows of 2,048 tokens, 2 gloo ranks): the bytes
    autograd keeps for backward per rank (bench_probe) at sp 2 are at most 0.6 of sp 1's, and ``hfsdp plan --sp``
    predicts each within 10 %. Memory, not time: the same on a busy machine."""
    import subprocess
    import sys

    from conftest import REPO, base_env

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sequence_parallel.py"), "--out", str(tmp_path),
                           "--model", "smollm2-tiny", "--seq-len", "2048", "--steps", "1", "--device-memory", "2GiB"],
                          capture_output=True, text=True, env=base_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    one, two = json.loads((tmp_path / "sequence_parallel.json").read_text())
    assert (one["sp"], two["sp"]) == (1, 2) and one["tokens_per_step"] == 2 * two["tokens_per_step"] == 2 * 2048
    assert two["measured"] <= 0.6 * one["measured"], (one, two)
    for row in (one, two):
        assert 0.9 <= row["planned"] / row["measured"] <= 1.1, row
    assert two["all_to_all_bytes"] > 0 == one["all_to_all_bytes"]
    assert two["longest_row"] > one["longest_row"], (one, two)


def test_plan_divides_the_activations_by_sp_and_says_the_all_to_all_bytes_and_the_longest_row(tmp_path):
    from conftest import tiny_config

    config = tiny_config(tmp_path, data={"max_seq_len": 2048}, train={"per_device_batch_size": 1})
    args = ("plan", str(config), "--nproc", "2,3", "--strategies", "FULL_SHARD", "--sp", "1,2", "--device-memory",
            "2GiB")
    rows = {(r["world"], r["sp_size"]): r for r in json.loads(run_cli(*args, "--json", env=RUN_ENV).stdout)["rows"]}
    one, two = rows[2, 1], rows[2, 2]
    assert 0.45 <= two["activations"] / one["activations"] <= 0.55, (one["activations"], two["activations"])
    assert two["params"] == one["params"] and two["shard_group"] == one["shard_group"] == 2  # FSDP2 over both ranks
    assert one["sp_comm"] == 0 < two["sp_comm"] and two["problem"] is None
    assert 1.5 * one["longest_row"] < two["longest_row"] < 2.1 * one["longest_row"], (one, two)
    assert "does not divide the world size 3" in rows[3, 2]["problem"] and rows[3, 1]["problem"] is None
    table = run_cli(*args, env=RUN_ENV).stdout
    assert "2 sp2" in table and "all-to-all GiB/step" in table and "longest row" in table, table


def test_activations_scaled_grow_with_the_tokens_and_count_the_loss_chunks_again():
    from hfsdp.tools.plan.facts import Activations

    acts = Activations(outside_layers=100, per_layer=(40, 40), layer_inputs=(10, 10), logits_bytes=1000, tokens=50,
                       chunk_bytes=300, chunk_count=4, last_chunk_bytes=100, head_grad_bytes=7)
    assert acts.scaled(1.0) == acts
    double = acts.scaled(2.0)
    assert (double.outside_layers, double.per_layer, double.layer_inputs, double.tokens) == (200, (80, 80), (20, 20), 100)
    # 1,000 bytes of chunks become 2,000: 7 chunks of 300, the last 200
    assert (double.chunk_count, double.last_chunk_bytes, double.chunk_bytes, double.head_grad_bytes) == (7, 200, 300, 7)


# ---- refused before any weight loads

def _world_problems(config: HfsdpConfig, world: int, local: int) -> list[tuple[str, str]]:
    """What a launched world of ``world`` ranks (``local`` per node) refuses of the config's degrees."""
    from hfsdp.layout.degrees import World

    return World(rank=0, size=world, local_size=local, on_cpu=True).with_dims(config).dims.problems(config)


def _config(**sections) -> HfsdpConfig:
    base = {"model": {"name_or_path": "x"}, "data": {"path": "x"}, "train": {"output_dir": "x", "max_steps": 1},
            "fsdp": {"version": 2}, "parallel": {"sp_size": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return HfsdpConfig.model_validate(base)


@pytest.mark.parametrize("degree", ["sp_size", "cp_size"])
@pytest.mark.parametrize("sections, key, says", [
    ({"fsdp": {"sharding_strategy": "HYBRID_SHARD"}}, "fsdp.sharding_strategy", "HYBRID_SHARD is not composed"),
    ({"fsdp": {"sharding_strategy": "NO_SHARD"}}, "fsdp.sharding_strategy", "NO_SHARD is not composed"),
    ({"parallel": {"tp_size": 2}}, "parallel.tp_size", "tensor x {what} parallelism is not built yet"),
    ({"model": {"attn_implementation": "eager"}}, "model.attn_implementation", "eager is not composed"),
    ({"train": {"compile": True}}, "train.compile", "{exchanged} inside are not tried yet"),
])
def test_what_sequence_and_context_parallelism_cannot_combine_with_is_named(degree, sections, key, says):
    what, exchanged = parallel.SPLITS[degree]
    config = _config(**{**sections, "parallel": {"sp_size": 1, degree: 2, **sections.get("parallel", {})}})
    problems = parallel.split_config_problems(config, degree)
    assert [k for k, _ in problems] == [key] and says.format(what=what, exchanged=exchanged) in problems[0][1]
    assert problems[0][1].startswith(f"parallel.{degree} 2: ") and f"or set parallel.{degree}: 1" in problems[0][1]


def test_a_plain_sequence_parallel_config_has_no_problems():
    assert parallel.config_problems(_config()) == []
    assert parallel.config_problems(_config(parallel={"sp_size": 1})) == []


@pytest.mark.parametrize("world, local, says", [
    (3, 3, "2 does not divide the world size 3"),
    (4, 1, "does not divide the 1 processes per node"),  # 4 nodes of 1: a group would span nodes
])
def test_the_world_must_hold_whole_sequence_parallel_groups(world, local, says):
    problems = _world_problems(_config(), world, local)
    assert [k for k, _ in problems] == ["parallel.sp_size"] and says in problems[0][1], problems
    assert _world_problems(_config(), 4, 2) == []


def test_sp_size_must_divide_the_heads_and_the_kv_heads():
    model = types.SimpleNamespace(model_type="llama", num_attention_heads=4, num_key_value_heads=2)
    assert parallel.model_problems(_config(), model) == []
    problems = parallel.model_problems(_config(parallel={"sp_size": 4}), model)
    assert problems == [("parallel.sp_size", "4 does not divide the model's num_key_value_heads (2): choose an "
                                             "sp_size that does (or parallel.cp_size, ring attention, which splits "
                                             "the positions and not the heads)")]
    assert parallel.model_problems(_config(parallel={"sp_size": 1, "cp_size": 4}), model) == []


def test_a_plugin_objective_with_sequence_parallelism_is_refused_by_validate(tmp_path):
    from conftest import tiny_config

    config = tiny_config(tmp_path, plugins=["dpo"], parallel={"sp_size": 2})
    proc = run_cli("validate", str(config), check=False, env=RUN_ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.sp_size" in proc.stderr and "dpo (a plugin's objective) is not composed with sequence" in proc.stderr


@pytest.mark.slow
def test_sp2_on_three_ranks_is_refused_before_any_weight_loads(tmp_path):
    from conftest import tiny_config

    config = tiny_config(tmp_path, parallel={"sp_size": 2})
    proc = run_torchrun(3, "train", str(config), check=False, env=RUN_ENV)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line or "parallel.sp_size" in line]
    assert any("2 does not divide the world size 3" in e for e in errors), proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- the pieces

def _whole_batch():
    from hfsdp.data.batches import micro_batch

    rows = [{"input_ids": list(range(10, 17)), "labels": [-100, -100, 12, 13, 14, 15, 16]},
            {"input_ids": list(range(20, 24)), "labels": [-100, 21, 22, 23]}]
    return micro_batch(rows, pad_id=0, device="cpu")


def test_a_rows_split_keeps_the_whole_rows_shifted_targets_and_positions():
    import torch

    from hfsdp.parallel.sequence import SPLIT, SequenceSplit

    whole = _whole_batch()
    parts = [SequenceSplit(size=2, rank=r, group=None).apply(_whole_batch(), "cpu") for r in (0, 1)]
    ids = torch.cat([p.inputs["input_ids"] for p in parts], dim=1)
    assert ids.shape == (2, 8)  # 7 positions padded to a multiple of 2
    assert torch.equal(ids[:, :7], whole.inputs["input_ids"]) and ids[:, 7].tolist() == [0, 0]
    assert torch.equal(torch.cat([p.inputs["position_ids"] for p in parts], dim=1), torch.arange(8).expand(2, 8))
    targets = torch.cat([p.targets for p in parts], dim=1)
    # position 3 (rank 0's last) predicts token 4 (rank 1's first): shifted before the split
    assert torch.equal(targets[:, :7], whole.targets) and targets[0, 3] == 14
    assert sum(p.num_targets for p in parts) == whole.num_targets == 8
    assert all("attention_mask" not in p.inputs and p.inputs[SPLIT].segments is None for p in parts)
    assert [p.lengths for p in parts] == [[7, 4], [7, 4]]  # the rows' (the step counts tokens once per group)
    for p in parts:
        flat = p.targets.reshape(-1)
        assert torch.equal(flat[p.label_positions], flat[flat != -100])


def test_packed_rows_split_with_their_sequences_spans_from_where_positions_restart():
    import torch

    from hfsdp.data.batches import micro_batch
    from hfsdp.parallel.sequence import SPLIT, SequenceSplit

    row = {"input_ids": list(range(1, 10)), "labels": list(range(1, 10)), "position_ids": [0, 1, 2, 3, 0, 1, 2, 0, 1]}
    part = SequenceSplit(size=2, rank=1, group=None).apply(micro_batch([row], pad_id=0, device="cpu"), "cpu")
    assert part.inputs[SPLIT].segments == [[(0, 4), (4, 7), (7, 9)]]  # in the whole row's positions
    # positions 5..9 of the row padded to 10: the padding's position goes on counting
    assert torch.equal(part.inputs["position_ids"], torch.tensor([[1, 2, 0, 1, 9]]))
    assert torch.equal(part.inputs["input_ids"], torch.tensor([[6, 7, 8, 9, 0]]))


def test_the_exchange_around_attention_computes_sdpa_over_whole_rows_and_its_gradients():
    """Threads as 2 ranks: each holds half the positions of q, k, v (4 heads, 2 KV heads, 2 rows of 12); the
    exchanged attention equals transformers' sdpa over the whole rows, causal, and with packed sequences each on its
    own; so do the gradients that reach each rank's q, k and v."""
    import torch
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hfsdp.model.packed_attention import sequence_sdpa
    from hfsdp.parallel.sequence import SPLIT, Exchange, split_sdpa
    from threaded_ranks import on_threads

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 12, 8, generator=g) for heads in (4, 2, 2))
    weights = torch.randn(2, 12, 4, 8, generator=g)

    def reference(segments):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kwargs = {"packed_segments": segments} if segments else {}
        out, _ = (sequence_sdpa if segments else sdpa_attention_forward)(module, *leaves, None, scaling=0.3, **kwargs)
        (out * weights).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    for segments in (None, [[(0, 5), (5, 12)], [(0, 12)]]):
        want, want_grads = reference(segments)

        def rank(r):
            part = slice(6 * r, 6 * r + 6)
            leaves = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
            out, _ = split_sdpa(module, *leaves, None, scaling=0.3,
                                  **{SPLIT: Exchange(dist.group.WORLD, 2, segments)})
            (out * weights[:, part]).sum().backward()
            return out.detach(), [t.grad for t in leaves]

        got = on_threads(2, rank)
        assert torch.allclose(torch.cat([o for o, _ in got], dim=1), want, atol=1e-6)
        for i in range(3):
            assert torch.allclose(torch.cat([grads[i] for _, grads in got], dim=2), want_grads[i], atol=1e-5)
