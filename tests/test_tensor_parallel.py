"""Tensor parallelism (``parallel.tp_size``, issue 37): the decoder layers' projections split over the ranks of a
tensor-parallel group, FSDP2 over the data-parallel ranks. The claims, on the tiny model's real architecture:

* tp 2 on 2 ranks and tp 2 x dp 2 on 4 ranks compute the steps, evals and weights of one process on the same
  global batch (float32 sums of other orders apart), with the same gradient norm;
* a 2-D checkpoint resumes bit for bit on its own layout, resumes on other data-parallel ranks (the global batch
  kept), is refused on another tensor-parallel size, and exports to the run's own final weights;
* what tensor parallelism cannot combine with is refused before any weight loads, with the key that says so.

The tp 2 cell of the smoke, resume and pairs matrices is in tests/test_combinations.py (option ``tp2``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from conftest import RUN_ENV, run_cli, run_torchrun
from hfsdp.config.schema import HfsdpConfig
from hfsdp.rules import parallel
from test_combinations import (STEPS, _merge, assert_resumed_exactly, exported, losses, read_metrics, resume, smoke_run,
                               smoke_sections, startup)

# tp 2 x dp 2 on 4 ranks of 1 row each: the global batch of 2 rows of the one-process smoke run (fsdp2-x1-base)
FOUR = ("fsdp2-x4-tp2-dp2", 4)


@pytest.fixture(scope="module")
def runs(run_registry):
    """The runs of the matrices (tests/test_combinations.py), shared: the one-process smoke run is made once."""
    return run_registry


def four_ranks(runs):
    key, world = FOUR
    return runs.run(key, world, _merge(smoke_sections(2, world, "tp2"), {"train": {"per_device_batch_size": 1}}))


def assert_computes_what_one_process_computes(run, one) -> None:
    """Losses, gradient norms and eval losses of ``run`` within float32 sums of other orders of ``one``'s (tp 2 on
    the tiny model: 1e-7 apart), and its exported weights within what 4 Adam steps make of such differences (1e-4,
    a thirtieth of one step)."""
    import torch

    a, b = read_metrics(run), read_metrics(one)
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    compared = 0
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=1e-5), (key, x, y)
                compared += 1
    assert compared >= 2 * STEPS
    got, want = exported(run)["model.safetensors"], exported(one)["model.safetensors"]
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        # Adam normalises each element's step: where a gradient is near 0, float32 noise in it moves the weight by
        # up to a step (lr 3e-3). A CI rehearsal measured 1.5e-5 (up_proj); a weight the split got wrong would be
        # a step or more apart.
        assert torch.allclose(got[name], tensor, rtol=1e-4, atol=1e-4), (name, (got[name] - tensor).abs().max())


@pytest.mark.slow
def test_tp2_on_two_ranks_computes_what_one_process_computes(runs):
    run, _ = smoke_run(runs, 2, 2, "tp2")
    one, _ = smoke_run(runs, 2, 1, "base")
    assert_computes_what_one_process_computes(run, one)


@pytest.mark.slow
def test_tp2_x_dp2_on_four_ranks_computes_what_one_process_computes(runs):
    """The test that found the gradient norm 5 % small (FSDP2's shard of a column split is a _StridedShard, which
    :func:`hfsdp.parallel.world.element_holders` counted as a replica)."""
    run, proc = four_ranks(runs)
    one, _ = smoke_run(runs, 2, 1, "base")
    assert_computes_what_one_process_computes(run, one)
    report = startup(run)
    assert report["tp_size"] == 2 and "over dp_shard 2 x tensor parallel 2" in report["strategy"], report
    assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"], report  # dp shards the rest
    assert "While redistributing" not in proc.stderr, proc.stderr[-3000:]  # torch's note on strided gathers


@pytest.mark.slow
def test_tp2_with_bf16_and_accumulation_computes_what_fsdp_alone_computes(runs):
    """tp 2 on 2 ranks, bf16 mixed precision, 2 micro-batches of 2 rows: the steps of the bf16 smoke run (FSDP2 on
    2 ranks of 2 rows: the same 4 rows a step), within what bf16 sums of other orders make (as FSDP1 vs FSDP2)."""
    from test_combinations import GRAD_REL, LOSS_REL

    sections = _merge(smoke_sections(2, 2, "tp2"), {"fsdp": {"mixed_precision": "bf16"},
                                                    "train": {"gradient_accumulation_steps": 2}})
    run, _ = runs.run("fsdp2-x2-tp2-bf16-accumulation", 2, sections)
    fsdp, _ = smoke_run(runs, 2, 2, "bf16")
    a, b = losses(run), losses(fsdp)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step][0] == pytest.approx(b[step][0], rel=LOSS_REL["bf16"]), (step, a, b)
        assert a[step][1] == pytest.approx(b[step][1], rel=GRAD_REL["bf16"]), (step, a, b)
    assert startup(run)["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_tp2_x_dp2_resumes_exactly(runs, tmp_path):
    run, _ = four_ranks(runs)
    assert_resumed_exactly(resume(tmp_path, run, FOUR[1]), run)


@pytest.mark.slow
def test_tp2_full_state_dict_checkpoints_resume_exactly(runs, tmp_path):
    """FULL_STATE_DICT checkpoints of a tensor-parallel run: the split weights gathered whole into model.safetensors
    (and the optimizer state into optimizer.bin), then split again on resume, bit for bit."""
    sections = _merge(smoke_sections(2, 2, "tp2"), {"fsdp": {"state_dict_type": "FULL_STATE_DICT"}})
    run, _ = runs.run("fsdp2-x2-tp2-full_state_dict", 2, sections)
    assert (run / "checkpoints" / "step-2" / "pytorch_model_fsdp.bin").is_file()  # Accelerate's full weights file
    assert_resumed_exactly(resume(tmp_path, run, 2), run)


@pytest.mark.slow
def test_a_2d_checkpoint_resumes_on_other_data_parallel_ranks(runs, tmp_path):
    """tp 2 x dp 2's step-2 checkpoint resumed on 2 ranks (tp 2 x dp 1): accumulation 2 keeps the global batch of 2
    rows, and steps 3 and 4 are the 4-rank run's (float32 sums of other orders apart)."""
    run, _ = four_ranks(runs)
    resumed = resume(tmp_path, run, 2)
    a, b = losses(resumed), losses(run)
    assert sorted(a) == [3, 4]
    for step in (3, 4):
        assert a[step] == pytest.approx(b[step], rel=1e-5), (step, a, b)


@pytest.mark.slow
def test_hfsdp_export_of_a_2d_checkpoint_writes_the_runs_final_weights(runs, tmp_path):
    import torch

    run, _ = four_ranks(runs)
    assert (run / "checkpoints" / f"step-{STEPS}" / "pytorch_model_fsdp_0").is_dir()  # SHARDED: DCP's files
    run_cli("export", str(run / "checkpoints" / f"step-{STEPS}"), str(tmp_path / "out"), env=RUN_ENV)
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "out" / "model.safetensors"), exported(run)["model.safetensors"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_checkpoint_resumes_on_its_own_tensor_parallel_size_only(runs, tmp_path):
    run, _ = four_ranks(runs)
    target = tmp_path / "run" / "checkpoints" / "step-2"
    shutil.copytree(run / "checkpoints" / "step-2", target)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["output_dir"] = str(tmp_path / "run")
    config["parallel"] = {"tp_size": 1}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = run_torchrun(2, "train", str(tmp_path / "config.yaml"), "--resume", check=False, env=RUN_ENV)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line]
    assert errors and all("it was saved with parallel.tp_size 2, this run has 1" in e for e in errors), errors
    assert "Loading weights" not in proc.stderr  # refused in the run's decision, before any weight loads
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert json.loads((target / "hfsdp_checkpoint.json").read_text())["tp_size"] == 2


# ---- the rules, torch-free: what tensor parallelism refuses, from the config, the world and the model's config

def _world_problems(config: HfsdpConfig, world: int, local: int) -> list[tuple[str, str]]:
    """What a launched world of ``world`` ranks (``local`` per node) refuses of the config's degrees."""
    from hfsdp.layout.degrees import World

    return World(rank=0, size=world, local_size=local, on_cpu=True).with_dims(config).dims.problems(config)


def _config(**sections) -> HfsdpConfig:
    base = {"model": {"name_or_path": "x"}, "data": {"path": "x"}, "train": {"output_dir": "x", "max_steps": 1},
            "fsdp": {"version": 2}, "parallel": {"tp_size": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return HfsdpConfig.model_validate(base)


@pytest.mark.parametrize("sections, key, says", [
    ({"fsdp": {"version": 1}}, "fsdp.version", "composes with FSDP2 only"),
    ({"fsdp": {"sharding_strategy": "HYBRID_SHARD"}}, "fsdp.sharding_strategy", "HYBRID_SHARD and NO_SHARD"),
    ({"fsdp": {"cpu_offload": True}}, "fsdp.cpu_offload", "not tensor-parallel ones"),
    ({"fsdp": {"cpu_ram_efficient_loading": True}}, "fsdp.cpu_ram_efficient_loading", "would split empty ones"),
    ({"model": {"quantization": {"bits": 4}}}, "model.quantization", "4-bit Linears cannot be split"),
    ({"train": {"compile": True}}, "train.compile", "cannot yet trace the split blocks"),
    ({"fsdp": {"wrap_policy": "size", "min_num_params": 1000}}, "fsdp.wrap_policy", "use wrap_policy transformer"),
    ({"parallel": {"dp_replicate_size": 2}}, "parallel.dp_replicate_size", "(HSDP x TP) are not composed yet"),
])
def test_what_tensor_parallelism_cannot_combine_with_is_named(sections, key, says):
    problems = parallel.config_problems(_config(**sections))
    assert [k for k, _ in problems] == [key] and says in problems[0][1], problems


def test_a_plain_tensor_parallel_config_has_no_problems():
    assert parallel.config_problems(_config()) == []
    assert parallel.config_problems(_config(parallel={"tp_size": 1})) == []


@pytest.mark.parametrize("world, local, dp_shard, says", [
    (3, 3, None, "2 does not divide the world size 3"),
    (4, 1, None, "does not divide the 1 processes per node"),  # 4 nodes of 1: a group would span nodes
    (8, 8, 2, "2 x tp_size 2 is 4, not the world size 8: set it to 4"),
])
def test_the_world_must_hold_whole_tensor_parallel_groups(world, local, dp_shard, says):
    config = _config(parallel={"tp_size": 2, "dp_shard_size": dp_shard})
    problems = _world_problems(config, world, local)
    assert len(problems) == 1 and says in problems[0][1], problems
    assert _world_problems(_config(parallel={"tp_size": 2, "dp_shard_size": 4}), 8, 8) == []


def test_the_models_plan_and_head_counts_are_checked_before_weights_load():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=256)
    assert parallel.model_problems(_config(), llama) == []
    assert parallel.tp_plan(llama)["layers.*.self_attn.q_proj"] == "colwise"
    odd = LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=256)
    problems = parallel.model_problems(_config(), odd)
    assert [m for _, m in problems] == ["2 does not divide the model's num_key_value_heads (3): choose a tp_size "
                                        "that does"], problems
    gpt2 = GPT2Config()  # transformers 5.24 gives GPT-2 no plan
    assert "gpt2 declares no tensor-parallel plan" in parallel.model_problems(_config(), gpt2)[0][1]


# ---- hfsdp plan: a 2-D layout's bytes per rank and its collectives per step

@pytest.mark.slow
def test_plan_predicts_the_parameter_bytes_every_rank_holds(runs):
    """plan's params per rank (the largest rank's) equal the bytes the tp 2 x dp 2 run's ranks and the tp 2 run's
    ranks hold (their start-up reports, counted from the live DTensor shards); gradients and AdamW's moments are
    the same shards."""
    for run, world in ((four_ranks(runs)[0], 4), (smoke_run(runs, 2, 2, "tp2")[0], 2)):
        live = [json.loads((run / f"startup_rank{r}.json").read_text())["param_bytes_this_rank"] for r in range(world)]
        proc = run_cli("plan", str(run / "config.yaml"), "--nproc", str(world), "--strategies", "FULL_SHARD", "--json",
                       env=RUN_ENV)
        (row,) = json.loads(proc.stdout)["rows"]
        assert row["tp_size"] == 2 and row["shard_group"] == world // 2, row
        assert row["params"] == max(live) and row["grads"] == row["params"] and row["optimizer"] == 2 * row["params"]


def test_plan_of_llama_70b_on_64_gpus_shards_tensor_parallel_slices_and_moves_fewer_bytes_across_nodes():
    """The 70B example (tp 8 inside each of 8 nodes): every split dimension divides by 8 and by 8 again, so a rank
    holds exactly 1/64 of each decoder matrix and 1/8 of the embedding, head and norms (kept whole by tensor
    parallelism, sharded by FSDP2); FSDP alone on the same 64 GPUs moves about 8x the bytes across nodes."""
    from conftest import REPO, base_env

    example = REPO / "examples" / "llama-3.1-70b-full-tp8.yaml"
    proc = run_cli("plan", str(example), "--nproc", "8", "--nodes", "8", "--tp", "1,8", "--strategies", "FULL_SHARD",
                   "--json", env=base_env(HF_HUB_OFFLINE="1"))
    alone, split = json.loads(proc.stdout)["rows"]
    assert (alone["tp_size"], split["tp_size"], split["shard_group"]) == (1, 8, 8)
    hidden, vocab, layers = 8192, 128256, 80
    matrices = 2 * hidden * hidden + 2 * 1024 * hidden + 3 * 28672 * hidden  # q, o; k, v; gate, up, down
    whole = 2 * vocab * hidden + layers * 2 * hidden + hidden  # embedding, head, norms
    assert split["params"] == 2 * (layers * matrices // 64 + whole // 8)  # bfloat16
    assert split["problem"] is None and split["fits"] and alone["fits"]
    assert alone["tp_comm"] == 0 and split["tp_comm"] > 0
    assert 7 < alone["fsdp_comm"] / split["fsdp_comm"] < 9, (alone["fsdp_comm"], split["fsdp_comm"])
    table = run_cli("plan", str(example), "--nproc", "8", "--nodes", "8", "--tp", "1,8", "--strategies", "FULL_SHARD",
                    env=base_env(HF_HUB_OFFLINE="1")).stdout
    assert "64 (8x8) tp8" in table and "comm GiB/step fsdp+tp" in table, table


def test_plan_rows_of_a_tensor_parallel_size_that_cannot_run_say_why():
    from conftest import REPO, base_env

    example = REPO / "examples" / "llama-3.1-70b-full-tp8.yaml"
    proc = run_cli("plan", str(example), "--nproc", "6", "--tp", "4,3", "--strategies", "FULL_SHARD", "--json",
                   env=base_env(HF_HUB_OFFLINE="1"))
    four, three = json.loads(proc.stdout)["rows"]
    assert four["problem"].startswith("parallel.tp_size: 4 does not divide the world size 6"), four
    assert three["problem"] == ("parallel.tp_size: 3 does not divide the model's num_attention_heads (64): choose a "
                                "tp_size that does"), three
    bad = run_cli("plan", str(example), "--tp", "two", check=False)
    assert bad.returncode == 2 and "--tp 'two'" in bad.stderr and "Traceback" not in bad.stderr
