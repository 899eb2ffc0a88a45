"""Multi-rank FSDP rehearsal on CPU: real ``torchrun`` jobs of 2 (and 4) gloo processes on the shrunk SmolLM2.

What is proven here, each against the real CLI:

* sharding is real: every rank's startup report (``<output_dir>/startup_rank<r>.json``) holds about 1/N of the
  parameter bytes under FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD (the shard group's 1/N), all of them under
  NO_SHARD, and the optimizer state follows the parameters;
* every strategy (FSDP2 and FSDP1) computes the same steps as one process on the same global batch: per-step losses
  and the exported ``final/`` weights match;
* SHARDED and FULL checkpoints saved on 2 ranks export (``hfsdp export``) to the weights the run had in memory at
  that step, and a SHARDED checkpoint resumes on 2 ranks to the losses of an uninterrupted run;
* ``cpu_ram_efficient_loading``: ranks > 0 read no weights and still end with rank 0's;
* the size wrap policy forms the units it says (modules over ``min_num_params``, tied embeddings kept together)
  under FSDP1 and FSDP2, on tied and untied models, and ``hfsdp plan`` predicts them;
* GPU-only options are refused up front (exit 2); a plugin failing on one rank ends the whole job, naming the plugin;
* LoRA under FSDP1 on 2 ranks saves the adapter one process saves.

The runs are shared between tests (module-scoped, built on first use), so the file costs about one run per
configuration.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import RunRegistry, base_env, read_metrics, run_cli, run_torchrun, step_losses, tiny_config
from test_combinations import STEPS, TRAIN, pair_sections, smoke_sections

pytestmark = pytest.mark.slow

# The steps of the smoke matrix (tests/test_combinations.py: constant LR, so that a run resumed with a larger
# max_steps follows the trajectory of one started with it; weight decay on; a checkpoint every 2 steps): the runs here
# that are matrix cells (:func:`cell`) are the matrix's own runs, trained once for both modules (conftest.RunRegistry).
LOSS_REL = 1e-4
# Weights move by up to ~1e-2 over the run (lr 3e-3). Float noise between micro-batch splits (1e-7 relative in the
# gradients) reaches ~3e-5 in the few elements whose gradients are near zero, where Adam divides by sqrt(v) + eps.
WEIGHT_ATOL = 5e-5


def _own(nproc: int, fsdp: dict, **train) -> tuple[int, dict]:
    return nproc, {"train": {**TRAIN, **train}, "fsdp": fsdp}


def cell(version: int, world: int, option: str) -> tuple[int, dict]:
    """A smoke-matrix cell: its world and sections, so that its run is the matrix's."""
    return world, smoke_sections(version, world, option)


# name: (processes, config sections). fsdp2_full is also the uninterrupted 6-step run that the resume test compares
# with, and holds SHARDED checkpoints (steps 2, 4, 6); the matrix's fsdp2-x2-full_state_dict holds FULL ones.
RUNS = {
    "single": _own(1, {"version": 2, "sharding_strategy": "FULL_SHARD"}, per_device_batch_size=4),
    # the eval before training: test_ram_efficient_loading_gives_every_rank_the_real_weights
    "fsdp2_full": _own(2, {"version": 2, "sharding_strategy": "FULL_SHARD", "state_dict_type": "SHARDED_STATE_DICT"},
                       max_steps=6, eval_at_start=True),
    "fsdp2_full_state_dict": cell(2, 2, "full_state_dict"),
    "fsdp2_grad_op": cell(2, 2, "shard_grad_op"),
    "fsdp2_no_shard": _own(2, {"version": 2, "sharding_strategy": "NO_SHARD"}),  # the matrix's no_shard resume run
    "fsdp2_hybrid_x4": _own(4, {"version": 2, "sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2},
                            per_device_batch_size=1),  # the matrix's hybrid_shard_x4 resume run
    "fsdp1_full": cell(1, 2, "full_state_dict"),
    "fsdp1_grad_op": cell(1, 2, "shard_grad_op"),
    "fsdp1_no_shard": _own(2, {"version": 1, "sharding_strategy": "NO_SHARD"}),
    "fsdp2_ram_efficient": _own(2, {"version": 2, "sharding_strategy": "FULL_SHARD", "cpu_ram_efficient_loading": True},
                                eval_at_start=True),
    # the same global batch of 4 as two micro-batches of 1 per rank, layers recomputed in backward
    "fsdp2_accum_ckpt": _own(2, {"version": 2, "sharding_strategy": "FULL_SHARD", "activation_checkpointing": True},
                             per_device_batch_size=1, gradient_accumulation_steps=2),
    "fsdp1_accum_ckpt": _own(2, {"version": 1, "sharding_strategy": "FULL_SHARD", "activation_checkpointing": True},
                             per_device_batch_size=1, gradient_accumulation_steps=2),
    # none wraps only the root
    "fsdp2_no_wrap": _own(2, {"version": 2, "wrap_policy": "none"}),
    # size: at 40000 parameters each decoder layer's MLP (49152) is a unit and the rest of a layer (12416) is not;
    # the tied embedding stays in the root (FSDP1; under FSDP2 Accelerate's final-norm/embedding/lm_head group).
    # Checkpointing recomputes the units. The untied model's own lm_head and embedding are units too.
    "fsdp1_size": _own(2, {"version": 1, "wrap_policy": "size", "min_num_params": 40000,
                           "activation_checkpointing": True}),
    "fsdp2_size": (2, pair_sections("checkpointing", "size_wrap")),  # the matrix's pair
    "single_untied": _own(1, {"version": 2}, per_device_batch_size=4),
    "fsdp1_size_untied": _own(2, {"version": 1, "wrap_policy": "size", "min_num_params": 40000}),
    "fsdp2_size_untied": _own(2, {"version": 2, "wrap_policy": "size", "min_num_params": 40000}),
    "single_bf16": _own(1, {"version": 2, "mixed_precision": "bf16"}, per_device_batch_size=4),
    "fsdp2_bf16": cell(2, 2, "bf16"),
}
SHARDED = {"fsdp2_full", "fsdp2_full_state_dict", "fsdp2_grad_op", "fsdp2_hybrid_x4", "fsdp1_full", "fsdp1_grad_op",
           "fsdp2_ram_efficient", "fsdp2_accum_ckpt", "fsdp1_accum_ckpt", "fsdp2_no_wrap", "fsdp2_bf16", "fsdp1_size",
           "fsdp2_size", "fsdp1_size_untied", "fsdp2_size_untied"}
SINGLE = {"single", "single_bf16", "single_untied"}
UNTIED = {"single_untied", "fsdp1_size_untied", "fsdp2_size_untied"}  # run on tiny_untied_model_dir
# Which one-process run each multi-rank run must match, and how closely: (reference, loss and grad-norm rel, weight
# atol); the others match "single" within (LOSS_REL, WEIGHT_ATOL). Measured: losses within 1e-7 and grad norms within
# 7e-5 (rel) for all; after 4 AdamW steps at lr 3e-3 the weights of the accumulation and no-wrap runs are 2.6e-5
# from one process (other float32 summation orders). bf16 runs compute in bf16 on micro-batches of other shapes (2
# rows of their own padding width per rank, not 4): losses within 1.4e-5 and grad norms within 6e-4 of the
# one-process bf16 run, weights within 8.2e-3 (a few learning-rate-sized steps).
REFERENCE = {"fsdp2_accum_ckpt": ("single", LOSS_REL, 5e-5), "fsdp1_accum_ckpt": ("single", LOSS_REL, 5e-5),
             "fsdp2_no_wrap": ("single", LOSS_REL, 5e-5), "fsdp2_bf16": ("single_bf16", 5e-3, 2e-2),
             "fsdp1_size": ("single", LOSS_REL, 5e-5), "fsdp2_size": ("single", LOSS_REL, 5e-5),
             "fsdp1_size_untied": ("single_untied", LOSS_REL, 5e-5),
             "fsdp2_size_untied": ("single_untied", LOSS_REL, 5e-5)}


class Runs:
    """This module's runs by name, from the session's registry (made on first use, once for every module)."""

    def __init__(self, registry: RunRegistry, untied_model: Path):
        self.registry = registry
        self.untied_model = untied_model

    def sections(self, name: str) -> dict:
        sections = RUNS[name][1]
        if name in UNTIED:
            sections = {**sections, "model": {"name_or_path": str(self.untied_model)}}
        return sections

    def __getitem__(self, name: str) -> Path:
        run, _ = self.registry.run(f"multirank-{name}", RUNS[name][0], self.sections(name))
        return run

    def config(self, name: str) -> Path:
        return self[name].parent / "config.yaml"


@pytest.fixture(scope="module")
def runs(run_registry, tiny_untied_model_dir):
    return Runs(run_registry, tiny_untied_model_dir)


def rank_reports(run: Path) -> list[dict]:
    reports = sorted(run.glob("startup_rank*.json"))
    return [json.loads(p.read_text()) for p in reports]


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = WEIGHT_ATOL) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def export(checkpoint: Path, out: Path) -> dict:
    """What ``hfsdp export CHECKPOINT OUT`` writes, in this process (one test runs the CLI itself)."""
    from hfsdp.export.pipeline import export_checkpoint, export_source

    return weights(export_checkpoint(export_source(checkpoint), out, []))


# ---- 1. sharding is real


@pytest.mark.parametrize("name", [n for n in RUNS if n not in SINGLE])
def test_each_rank_holds_its_share(runs, name):
    nproc, fsdp = RUNS[name][0], RUNS[name][1]["fsdp"]
    reports = rank_reports(runs[name])
    assert [r["rank"] for r in reports] == list(range(nproc))
    full = reports[0]["param_bytes_full_model"]
    group = fsdp.get("hybrid_shard_size", nproc) if name in SHARDED else 1
    for r in reports:
        assert r["world_size"] == nproc and r["param_bytes_full_model"] == full
        assert r["distributed_type"] == ("MULTI_CPU" if name == "fsdp2_no_shard" else "FSDP")
        local = r["param_bytes_this_rank"]
        assert abs(local - full / group) <= 0.01 * full, (name, r)
        # AdamW keeps two moments per parameter element it holds (plus one scalar step per parameter)
        assert abs(r["optimizer_state_bytes_this_rank"] - 2 * local) <= 0.01 * local + 4096, (name, r)
    if name in SHARDED and fsdp["version"] == 2 and group == nproc:  # DTensor shards partition the parameters
        assert sum(r["param_bytes_this_rank"] for r in reports) == full


def test_an_unsharded_model_is_refused_at_startup():
    """The guard behind the rehearsal adaptation: a model that stayed whole under a sharding strategy stops the run."""
    from types import SimpleNamespace

    import torch

    from hfsdp.run.startup import startup_report
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.layout.degrees import World
    from hfsdp.errors import UserError
    from hfsdp.setup.decide import decide

    config = HfsdpConfig(model={"name_or_path": "x"}, data={"path": "x"}, train={"output_dir": "x", "max_steps": 1},
                         fsdp={"sharding_strategy": "FULL_SHARD"})
    setup = decide(config, World(rank=0, size=2, local_size=2, on_cpu=True), resume=None)
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="FSDP"))
    with pytest.raises(UserError, match="did not end up sharded: this rank holds 160 of 160 parameter bytes"):
        startup_report(setup, accelerator, torch.nn.Linear(4, 8))


# ---- 2. every strategy computes the single-process steps


def step_grad_norms(run: Path) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in read_metrics(run) if "grad_norm" in m}


@pytest.mark.parametrize("name", [n for n in RUNS if n not in SINGLE])
def test_losses_grad_norms_and_final_weights_match_one_process(runs, name, tmp_path):
    reference_name, rel, atol = REFERENCE.get(name, ("single", LOSS_REL, WEIGHT_ATOL))
    single = runs[reference_name]
    reference, norms = step_losses(single), step_grad_norms(single)
    losses, got_norms = step_losses(runs[name]), step_grad_norms(runs[name])
    assert len(reference) == STEPS and len(losses) == RUNS[name][1]["train"]["max_steps"]
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=rel), (name, step, losses, reference)
        assert got_norms[step] == pytest.approx(norms[step], rel=rel), (name, step, got_norms, norms)
    if name == "fsdp2_full":  # trains on to step 6: its step-4 weights are those of its SHARDED checkpoint
        at_step_4 = export(runs[name] / "checkpoints" / f"step-{STEPS}", tmp_path / "step4")
    else:
        at_step_4 = weights(runs[name] / "final")
    assert_same_weights(at_step_4, weights(single / "final"), atol=atol)


def test_wrap_policies_and_activation_checkpointing_took_effect(runs):
    """The runs above differ in what they say they do: units formed by each policy, recomputation in backward."""
    assert rank_reports(runs["fsdp2_no_wrap"])[0]["wrapped_units"] < rank_reports(runs["fsdp2_full"])[0]["wrapped_units"]
    for name in ("fsdp2_accum_ckpt", "fsdp1_accum_ckpt"):
        assert rank_reports(runs[name])[0]["checkpointed_layers"] == 2, name  # both decoder layers recompute
    assert rank_reports(runs["single"])[0]["checkpointed_layers"] == 0


SIZE_UNITS = {"tied": ["model.layers.0.mlp", "model.layers.1.mlp"],
              "untied": ["model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "lm_head"]}


@pytest.mark.parametrize("name", ["fsdp1_size", "fsdp2_size", "fsdp1_size_untied", "fsdp2_size_untied"])
def test_size_wrap_policy_forms_the_units_plan_predicts(runs, name):
    """The seeds' size policy under both FSDP versions, tied and untied (each run also matches one process in
    test_losses_grad_norms_and_final_weights_match_one_process): every MLP of 49152 parameters is a unit, the rest
    of a layer is not, a tied embedding is never split from its lm_head (FSDP1 keeps both in the root; Accelerate's
    FSDP2 puts the final norm, embedding and lm_head in one group), an untied one is a unit of its own. ``hfsdp
    plan`` lists the same policy units."""
    version = RUNS[name][1]["fsdp"]["version"]
    expected = SIZE_UNITS["untied" if name in UNTIED else "tied"]
    names = rank_reports(runs[name])[0]["wrapped_unit_names"]
    if version == 1:
        assert names == ["<root>", *expected], names
    elif name in UNTIED:  # Accelerate groups what is left of the tail: the final norm
        assert names == ["<root>", *expected[:3], "model.norm", expected[3]], names
    else:
        assert names == ["<root>", "model.embed_tokens+model.norm+lm_head", *expected], names
    proc = run_cli("plan", str(runs.config(name)), "--nproc", "2", "--json", timeout=300)
    assert json.loads(proc.stdout)["fsdp_unit_names"] == ["<root>", *expected]
    if name in ("fsdp1_size", "fsdp2_size"):
        assert rank_reports(runs[name])[0]["checkpointed_layers"] == 2  # the two MLP units recompute


# ---- 3. checkpoints: export and resume


def test_sharded_and_full_checkpoints_export_the_in_memory_weights(runs, tmp_path):
    sharded, full = runs["fsdp2_full"], runs["fsdp2_full_state_dict"]  # SHARDED (steps 2, 4, 6), FULL (2, 4)
    assert (sharded / "checkpoints" / "step-6" / "pytorch_model_fsdp_0").is_dir()
    assert (full / "checkpoints" / "step-4" / "pytorch_model_fsdp.bin").is_file()
    # a checkpoint at the last step exports exactly what the run gathered from its ranks' memory (final/)
    proc = run_cli("export", str(sharded / "checkpoints" / "step-6"), str(tmp_path / "s6"))  # the real CLI once
    assert "exported" in proc.stdout
    assert_same_weights(weights(tmp_path / "s6"), weights(sharded / "final"), atol=0)
    assert_same_weights(export(full / "checkpoints" / "step-4", tmp_path / "f4"), weights(full / "final"), atol=0)
    # mid-run: a SHARDED and a FULL checkpoint of the same step (two runs on the same trajectory) agree
    assert_same_weights(export(sharded / "checkpoints" / "step-2", tmp_path / "s2"),
                        export(full / "checkpoints" / "step-2", tmp_path / "f2"))


def test_hybrid_shard_checkpoint_of_two_simulated_nodes_exports_one_folder(runs, tmp_path):
    """4 processes as 2 nodes x 2: a SHARDED checkpoint written by both replica groups exports whole."""
    checkpoint = runs["fsdp2_hybrid_x4"] / "checkpoints" / f"step-{STEPS}"
    assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert_same_weights(export(checkpoint, tmp_path / "hybrid"), weights(runs["fsdp2_hybrid_x4"] / "final"), atol=0)


def test_fsdp1_checkpoints_export_the_final_weights(runs, tmp_path):
    for name, layout in (("fsdp1_full", "pytorch_model_fsdp.bin"), ("fsdp1_grad_op", "pytorch_model_fsdp_0")):
        checkpoint = runs[name] / "checkpoints" / f"step-{STEPS}"
        assert (checkpoint / layout).exists()
        assert_same_weights(export(checkpoint, tmp_path / name), weights(runs[name] / "final"), atol=0)


def test_sharded_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    """A 4-step run stopped after its step-4 SHARDED checkpoint, resumed with max_steps 6, against the same 6 steps
    run without interruption (fsdp2_full; constant LR, so the first 4 steps of both are the same run)."""
    uninterrupted = runs["fsdp2_full"]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
    (run / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["step"] <= STEPS))
    sections = RUNS["fsdp2_full"][1]
    config = tiny_config(tmp_path, fsdp=sections["fsdp"], train={**sections["train"], "max_steps": STEPS})  # into run
    proc = run_torchrun(2, "train", str(config), "--resume", "--set", "train.max_steps=6")
    assert f"resumed from {run / 'checkpoints' / 'step-4'} at step 4" in proc.stdout + proc.stderr
    resumed, reference = step_losses(run), step_losses(uninterrupted)
    assert sorted(resumed) == list(range(1, 7))
    for step in (5, 6):
        assert resumed[step] == reference[step], (step, resumed, reference)  # bit for bit
    assert_same_weights(weights(run / "final"), weights(uninterrupted / "final"), atol=0)  # equal tensors


# ---- 5. cpu_ram_efficient_loading and refused options


def test_ram_efficient_loading_gives_every_rank_the_real_weights(runs):
    efficient, plain = runs["fsdp2_ram_efficient"], runs["fsdp2_full"]
    before = [json.loads(line) for line in (efficient / "metrics.jsonl").read_text().splitlines()]
    before_plain = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    # the eval before training sums both ranks' losses: rank 1 must hold rank 0's weights, not uninitialised ones
    assert before[0]["step"] == 0 and before[0]["eval_loss"] == pytest.approx(before_plain[0]["eval_loss"], rel=1e-6)
    plain_losses = step_losses(plain)
    assert step_losses(efficient) == pytest.approx({s: plain_losses[s] for s in range(1, STEPS + 1)}, rel=1e-6)
    reports = rank_reports(efficient)  # sharding and final weights: the tests above, like every other run
    plain_rank1 = rank_reports(plain)[1]["peak_rss_bytes_after_sharding"]
    print(f"\nrank 1 peak RSS after sharding: {reports[1]['peak_rss_bytes_after_sharding'] / 2**20:.0f} MiB with "
          f"cpu_ram_efficient_loading, {plain_rank1 / 2**20:.0f} MiB without (tiny model: "
          f"{reports[1]['param_bytes_full_model'] / 2**20:.1f} MiB of parameters)")


def test_gpu_only_options_are_refused_in_rehearsal(tmp_path):
    config = tiny_config(tmp_path, fsdp={"cpu_offload": True})
    proc = run_cli("train", str(config), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fsdp.cpu_offload: needs a GPU; CPU rehearsal mode cannot run it" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rehearsal_problems_name_every_gpu_only_option():
    from hfsdp.config.schema import FSDPConfig, HfsdpConfig
    from hfsdp.layout.degrees import ParallelDims
    from hfsdp.rules.wrapping import rehearsal_problems

    def problems(**fsdp):
        config = HfsdpConfig(model={"name_or_path": "x"}, data={"path": "x"}, train={"output_dir": "x", "max_steps": 1},
                             fsdp=FSDPConfig(**fsdp))
        return [option for option, _ in rehearsal_problems(config, ParallelDims())]  # (one process)

    assert problems() == []
    assert problems(version=2, cpu_ram_efficient_loading=True) == []
    assert problems(version=1, cpu_ram_efficient_loading=True) == ["fsdp.version 1 with cpu_ram_efficient_loading"]
    assert problems(version=1, sharding_strategy="HYBRID_SHARD") == ["fsdp.version 1 with HYBRID_SHARD"]
    assert problems(cpu_offload=True) == ["fsdp.cpu_offload"]
    assert problems(version=1, sync_module_states=True) == ["fsdp.sync_module_states"]


# ---- 6. a failure on one rank ends the whole job


FAILING_PLUGIN = '''
from hfsdp import hookimpl


@hookimpl
def hfsdp_on_step_end(run, step, metrics):
    if run.accelerator.process_index == 1 and step == 2:
        raise RuntimeError("deliberate failure on rank 1")
'''


def test_plugin_failure_on_one_rank_ends_the_job(tmp_path):
    (tmp_path / "fails_on_rank1.py").write_text(FAILING_PLUGIN)
    config = tiny_config(tmp_path, train=TRAIN, plugins=["fails_on_rank1"])
    t0 = time.perf_counter()
    proc = run_torchrun(2, "train", str(config), env=base_env(PYTHONPATH=str(tmp_path)), timeout=120, check=False)
    elapsed = time.perf_counter() - t0
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("[rank 1] hfsdp: plugin 'fails_on_rank1' failed in hook 'hfsdp_on_step_end': "
            "RuntimeError: deliberate failure on rank 1") in output
    assert not (tmp_path / "run" / "final").exists()
    print(f"\nrank-1 plugin failure ended the 2-rank job in {elapsed:.1f}s (exit {proc.returncode})")


# ---- 7. LoRA under FSDP1 on 2 ranks (test_lora.py covers FSDP2)


def test_lora_adapter_under_fsdp1_on_two_ranks_equals_one_process(tmp_path):
    import torch
    from safetensors.torch import load_file

    def train(name: str, nproc: int, fsdp: dict, per_device: int) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        config = tiny_config(folder, plugins=["lora"], lora={"r": 4, "alpha": 8}, fsdp=fsdp,
                             train={**TRAIN, "per_device_batch_size": per_device, "learning_rate": 1e-2})
        run_cli("train", str(config)) if nproc == 1 else run_torchrun(nproc, "train", str(config))
        return folder / "run"

    one = train("one", 1, {"version": 2}, 4)
    two = train("two", 2, {"version": 1, "sharding_strategy": "FULL_SHARD"}, 2)
    a = load_file(str(two / "final" / "adapter_model.safetensors"))
    b = load_file(str(one / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=WEIGHT_ATOL, rtol=0, msg=key)
    assert step_losses(two) == pytest.approx(step_losses(one), rel=LOSS_REL)


def test_summary_reports_each_ranks_peak_memory_and_per_device_throughput(runs):
    summary = json.loads((runs["fsdp2_full"] / "summary.json").read_text())["throughput"]
    assert len(summary["peak_memory_gib_per_rank"]) == 2 and min(summary["peak_memory_gib_per_rank"]) > 0.05
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 2)
