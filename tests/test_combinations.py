"""Options combined, not only alone (issue 28): a smoke matrix and a resume matrix of real CLI runs on the tiny preset.

* Smoke: FSDP1/FSDP2 x one process (``fsdp.single_process: fsdp``, a one-rank FSDP) / 2 gloo ranks x the common
  options (:data:`OPTIONS`). Every run trains 4 steps, saves at step 2 and 4, and exports ``final/``; the option is
  proven to have acted (checkpointed layers, packed rows, adapters, a bf16 run's other losses, ...). FSDP1 and FSDP2
  of the same option and world compute the same steps (weight decay on, so FSDP1's flat parameters are covered).
* Resume: a run ``--resume``d from the step-2 checkpoint of its smoke run gives the same losses at steps 3 and 4
  and the same exported weights, bit for bit (``torch.equal``).

Runs are made once per module and shared between the tests that read them (:class:`Runs`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import PRESET_DATA, read_metrics, run_cli, run_torchrun, tiny_config

pytestmark = pytest.mark.slow

STEPS = 4
# Constant LR: a resumed run continues the same schedule whatever max_steps it is given; weight decay on, so that
# which parameters decay (FSDP1 flattens them) is part of every comparison.
TRAIN = {"max_steps": STEPS, "save_every": 2, "lr_scheduler": "constant", "weight_decay": 0.1,
         "eval_at_start": False, "max_eval_batches": 1, "per_device_batch_size": 2,
         "collective_timeout_s": 120}  # a hang fails in minutes
LORA = {"plugins": ["lora"]}
PACKING = {"plugins": ["packing"], "data": {"max_seq_len": 256}}  # rows of ~80 tokens: about 3 per packed row

# Preference objectives on the bundled pairs. DPO (plugin dpo): full fine-tuning, reference log-probs precomputed
# and cached; ORPO full fine-tuning (its NLL a token mean over the global batch); SimPO with LoRA and its NLL term.
PAIRS_DATA = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_pref_eval.jsonl")}
DPO = {"plugins": ["dpo"], "data": PAIRS_DATA}

# option name -> config sections merged over the tiny preset
OPTIONS = {
    "base": {},
    "checkpointing": {"fsdp": {"activation_checkpointing": True}},
    "packing": PACKING,
    "lora": LORA,
    "bf16": {"fsdp": {"mixed_precision": "bf16"}},
    "accumulation": {"train": {"per_device_batch_size": 1, "gradient_accumulation_steps": 2}},
    "shard_grad_op": {"fsdp": {"sharding_strategy": "SHARD_GRAD_OP"}},
    "lora_checkpointing": {**LORA, "fsdp": {"activation_checkpointing": True}},
    "lora_packing": {**PACKING, "plugins": ["lora", "packing"]},
    "full_state_dict": {"fsdp": {"state_dict_type": "FULL_STATE_DICT"}},
    "lora_full_state_dict": {**LORA, "fsdp": {"state_dict_type": "FULL_STATE_DICT"}},
    "size_wrap": {"fsdp": {"wrap_policy": "size", "min_num_params": 40_000}},  # the seeds' policy, tied model
    "plain_loss": {"train": {"chunked_loss": False}},  # the full-logits loss (the chunked one is the default)
    "compile": {"train": {"compile": True}},  # each block compiled in place (Inductor)
    "async_save": {"train": {"async_save": True}},  # checkpoints written in the background
    "dpo": DPO,
    "orpo": {"plugins": ["orpo"], "data": PAIRS_DATA},
    "lora_simpo": {"plugins": ["lora", "simpo"], "data": PAIRS_DATA, "simpo": {"nll_weight": 1.0}},
    "mixture": {"data": {"path": None, "datasets": [  # two sources 3:1, the second with its own format
        {"path": str(PRESET_DATA / "contacts_train.jsonl"), "weight": 3},
        {"path": str(PRESET_DATA / "contacts_eval.jsonl"), "format": "chat", "weight": 1}]}},
    "qlora": {**LORA, "model": {"quantization": {"bits": 4}}},  # 4-bit nf4 base, sharded (float32 storage)
}
# Options of the data alone (the rows each step trains on, the same under any wrapper): FSDP2 only.
DATA_OPTIONS = ("mixture",)
# Resume cases beyond the smoke runs: (world, fsdp overrides), FSDP2 only.
EXTRA = {
    "no_shard": (2, {"sharding_strategy": "NO_SHARD"}),
    "hybrid_shard_x4": (4, {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}),
}
# torch's FSDP1 asserts on one shard of frozen tied weights: LoRA of the tied tiny model under FSDP1 on one process
# is refused with that reason (hfsdp.builtin.lora) instead of crashing at the first forward.
REFUSED = {(1, 1, name): "LoRA on a model with tied embeddings under FSDP1 with a single shard"
           for name in OPTIONS if name.startswith("lora")}
# hfsdp compiles blocks before FSDP2 shards them; FSDP1 flattens them first: refused in validation.
REFUSED.update({(1, world, "compile"): "train.compile: FSDP1 flattens each unit's parameters" for world in (1, 2)})
# DCP's host-memory staging cannot copy FSDP1's ShardedTensors: refused in validation.
REFUSED.update({(1, world, "async_save"): "train.async_save: FSDP1's sharded state dict holds ShardedTensors"
                for world in (1, 2)})
# QLoRA runs under FSDP2 only: refused in validation (hfsdp.quantization).
REFUSED.update({(1, world, "qlora"): "QLoRA runs under FSDP2 only" for world in (1, 2)})
# FSDP1 and FSDP2 of the same option: other float32 summation orders (flat parameters) within this; bf16 computes
# in bf16, where FSDP1 also casts the buffers.
LOSS_REL = {"bf16": 2e-3}
DEFAULT_LOSS_REL = 1e-5
GRAD_REL = {"bf16": 5e-2}
DEFAULT_GRAD_REL = 1e-3


def _merge(*parts: dict) -> dict:
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return merged


class Runs:
    """Runs made on first use and kept for the module: ``get(key)`` -> the run folder (or the failed process)."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[str, tuple[Path, object]] = {}

    def run(self, key: str, world: int, sections: dict, *extra: str, config_dir: Path | None = None,
            check: bool = True):
        if key in self.done:
            return self.done[key]
        folder = config_dir or (self.root / key)
        folder.mkdir(parents=True, exist_ok=True)
        config = tiny_config(folder, **sections)
        args = ("train", str(config), *extra)
        proc = (run_cli(*args, check=check) if world == 1 else run_torchrun(world, *args, check=check))
        self.done[key] = (folder / "run", proc)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("combinations"))


def smoke_sections(version: int, world: int, option: str) -> dict:
    fsdp = {"version": version, "sharding_strategy": "FULL_SHARD", "single_process": "fsdp"}
    return _merge({"train": TRAIN, "fsdp": fsdp}, OPTIONS[option])


def smoke_run(runs: Runs, version: int, world: int, option: str):
    return runs.run(f"fsdp{version}-x{world}-{option}", world, smoke_sections(version, world, option),
                    check=(version, world, option) not in REFUSED)


def losses(run: Path) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run) if "loss" in m}


def exported(run: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"nothing exported in {run / 'final'}"
    return {f.name: load_file(f) for f in files}


def startup(run: Path) -> dict:
    return json.loads((run / "startup_rank0.json").read_text())


SMOKE = [(v, w, o) for o in OPTIONS for v in (1, 2) for w in (1, 2) if v == 2 or o not in DATA_OPTIONS]


@pytest.mark.parametrize("version,world,option", SMOKE, ids=[f"fsdp{v}-x{w}-{o}" for v, w, o in SMOKE])
def test_smoke(runs, version, world, option):
    run, proc = smoke_run(runs, version, world, option)
    if (version, world, option) in REFUSED:
        if world == 1:
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        else:  # torchrun reports its failed workers with a traceback of its own; each rank's error is one line,
            # and the first rank to fail ends the others (a refusal in validation may leave only one line)
            assert proc.returncode != 0 and re.search(r"\[rank [01]\] hfsdp: error:", proc.stderr), proc.stderr[-3000:]
        assert REFUSED[version, world, option] in proc.stderr, proc.stderr[-3000:]
        assert "Loading weights" not in proc.stderr  # refused from the model's config, before its weights load
        assert not (run / "checkpoints").exists()
        return
    assert proc.stderr.count("Loading weights:   0%") == 1, proc.stderr[-3000:]  # rank 0's bar alone
    assert "deprecated" not in proc.stderr, proc.stderr[-3000:]  # Accelerate calls FSDP1's sharding_strategy so
    steps = losses(run)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(loss == loss and 0 < loss < 20 for loss, _ in steps.values()), steps
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
    weights = exported(run)
    report = startup(run)
    assert report["distributed_type"] == "FSDP" and report["fsdp_version"] == version
    sections = smoke_sections(version, world, option)
    assert (report["checkpointed_layers"] > 0) == bool(sections["fsdp"].get("activation_checkpointing"))
    if "lora" in option:
        assert "adapter_model.safetensors" in weights
    else:
        assert "model.safetensors" in weights
    if option == "qlora":
        assert report["quantized_base"]["sharded"], report  # a DTensor on one rank too (single_process: fsdp)
    if "packing" in option:
        summary = json.loads((run / "summary.json").read_text())
        packed = summary["data"]["padding"]
        assert "samples packed into" in packed and int(packed.split("into ")[1].split()[0]) < 1000, packed
    if option == "mixture":
        sources = json.loads((run / "summary.json").read_text())["data"]["sources"]
        assert [(s["rows"], s["share_planned"]) for s in sources] == [(1000, 0.75), (64, 0.25)], sources
    if option == "compile":
        assert max(m.get("compile_graphs", 0) for m in read_metrics(run)) > 0
    if option == "async_save":  # each checkpoint complete once, written while training went on
        assert report["checkpoint_saves"] == "asynchronous"
        assert [m["checkpoint_step"] for m in read_metrics(run) if "save_write_s" in m] == [2, 4]
    if option == "size_wrap":  # units of the policy's own (the MLPs of the tiny model), besides the root
        assert report["wrapped_units"] >= 3, report
    if world == 2 and sections["fsdp"].get("sharding_strategy") != "NO_SHARD":
        assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"]


PAIRS = [(w, o) for o in OPTIONS for w in (1, 2) if (1, w, o) not in REFUSED and o not in DATA_OPTIONS]


@pytest.mark.parametrize("world,option", PAIRS, ids=[f"x{w}-{o}" for w, o in PAIRS])
def test_fsdp1_computes_what_fsdp2_computes(runs, world, option):
    one, _ = smoke_run(runs, 1, world, option)
    two, _ = smoke_run(runs, 2, world, option)
    a, b = losses(one), losses(two)
    for step in range(1, STEPS + 1):
        assert a[step][0] == pytest.approx(b[step][0], rel=LOSS_REL.get(option, DEFAULT_LOSS_REL)), (step, a, b)
        assert a[step][1] == pytest.approx(b[step][1], rel=GRAD_REL.get(option, DEFAULT_GRAD_REL)), (step, a, b)


def test_two_ranks_of_one_pair_each_compute_what_one_process_of_two_pairs_computes(runs):
    """ORPO's NLL term is a token mean over the global batch (its tokens summed over the ranks before the
    forwards): 2 ranks of 1 pair each give the losses, NLL, metrics and evals of the one-process smoke run."""
    one, _ = smoke_run(runs, 2, 1, "orpo")
    sections = _merge(smoke_sections(2, 2, "orpo"), {"train": {"per_device_batch_size": 1}})
    two, _ = runs.run("fsdp2-x2-orpo-1pair", 2, sections)
    a, b = read_metrics(one), read_metrics(two)
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    compared = 0
    for x, y in zip(a, b):
        for key in ("loss", "nll_loss", "rewards/margins", "log_odds_ratio", "eval_loss", "eval_nll_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x, y)  # margins near 0
                compared += 1
        if "grad_norm" in x:  # float32 sums of other orders over the shards
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), (x, y)
    assert compared >= 4 * STEPS


def test_options_act(runs):
    """Each option changes the run it is added to (a matrix of options that silently did nothing would pass)."""
    base = losses(smoke_run(runs, 2, 2, "base")[0])
    for option in ("packing", "lora", "bf16", "dpo", "orpo", "lora_simpo", "mixture"):
        changed = losses(smoke_run(runs, 2, 2, option)[0])
        assert changed[2][0] != base[2][0], option
    # accumulation and checkpointing compute the same steps: same losses, other micro-batches / recomputation
    for option in ("accumulation", "checkpointing", "plain_loss", "compile"):
        same = losses(smoke_run(runs, 2, 2, option)[0])
        assert same[STEPS][0] == pytest.approx(base[STEPS][0], rel=1e-4), option


def resume(runs: Runs, key: str, uninterrupted: Path, world: int) -> Path:
    """A copy of ``uninterrupted``'s step-2 checkpoint resumed to step 4 in a run folder of its own."""
    folder = runs.root / f"{key}-resumed"
    target = folder / "run" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / "step-2", target / "step-2")
    config = yaml.safe_load((uninterrupted / "config.yaml").read_text())
    config["train"]["output_dir"] = str(folder / "run")
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    args = ("train", str(folder / "config.yaml"), "--resume")
    proc = run_cli(*args) if world == 1 else run_torchrun(world, *args)
    assert f"resumed from {target / 'step-2'} at step 2" in proc.stdout + proc.stderr
    assert "UserWarning" not in proc.stderr, proc.stderr[-3000:]  # FSDP1's load printed torch's deprecations
    return folder / "run"


def assert_resumed_exactly(resumed: Path, uninterrupted: Path) -> None:
    import torch

    a, b = losses(resumed), losses(uninterrupted)
    assert sorted(a) == [3, 4]
    for step in (3, 4):
        assert a[step] == b[step], (step, a, b)  # loss and grad norm, bit for bit
    got, want = exported(resumed), exported(uninterrupted)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert torch.equal(got[name][key], tensor), (name, key)


# async_save resumes exactly on 2 ranks in test_reliability.py (the same combination, resumed after a kill -9 of
# rank 1 mid-write: test_async_kill_9_of_rank_1_mid_background_write_then_the_resume_is_bit_exact_on_two_ranks),
# so it is not run again here.
RESUME = ([(v, w, o) for v in (1, 2) for w in (1, 2)
           for o in ("base", "full_state_dict", "lora", "lora_full_state_dict") if (v, w, o) not in REFUSED]
          + [(2, 2, o) for o in ("packing", "checkpointing", "bf16", "accumulation", "shard_grad_op",
                                      "size_wrap", "plain_loss", "compile", "dpo", "orpo", "lora_simpo",
                                      "mixture")]
          + [(2, 2, "qlora")])


@pytest.mark.parametrize("version,world,option", RESUME, ids=[f"fsdp{v}-x{w}-{o}" for v, w, o in RESUME])
def test_resume_is_exact(runs, version, world, option):
    run, _ = smoke_run(runs, version, world, option)
    assert_resumed_exactly(resume(runs, f"fsdp{version}-x{world}-{option}", run, world), run)


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_resume_is_exact_fsdp2(runs, name):
    world, fsdp = EXTRA[name]
    sections = _merge({"train": TRAIN, "fsdp": {"version": 2, **fsdp}},
                      {"train": {"per_device_batch_size": 1}} if world == 4 else {})
    run, _ = runs.run(f"fsdp2-x{world}-{name}", world, sections)
    assert_resumed_exactly(resume(runs, f"fsdp2-x{world}-{name}", run, world), run)


def test_a_changed_optimizer_state_is_refused_on_resume(runs, tmp_path):
    """The check after loading: a checkpoint whose optimizer moments are not what the run had when it saved them
    (here: Adam's first moments doubled in the FULL optimizer file) is refused on every rank, before a step."""
    import torch

    run, _ = smoke_run(runs, 2, 2, "full_state_dict")
    folder = tmp_path / "tampered"
    shutil.copytree(run / "checkpoints" / "step-2", folder / "run" / "checkpoints" / "step-2")
    optimizer_file = folder / "run" / "checkpoints" / "step-2" / "optimizer.bin"
    state = torch.load(optimizer_file, weights_only=True)
    for per_param in state["state"].values():
        per_param["exp_avg"] = per_param["exp_avg"] * 2
    torch.save(state, optimizer_file)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["output_dir"] = str(folder / "run")
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = run_torchrun(2, "train", str(folder / "config.yaml"), "--resume", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line]
    assert len(errors) == 2, proc.stderr[-3000:]  # one per rank
    assert all("the optimizer state restored from" in e and "exp_avg sums to" in e for e in errors), errors
    assert "exp_avg_sq" not in errors[0].split("exp_avg sums to")[1].split(";")[0]
    assert not (folder / "run" / "metrics.jsonl").exists()  # refused before the first step
