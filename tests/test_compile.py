"""``train.compile`` and ``model.attn_implementation`` (issue 21): what is refused before any weight loads, and real
runs where compiled transformer blocks (with activation checkpointing and packing) train the eager steps, on one
process (Inductor) and on 2 FSDP2 ranks, without recompiling after the warm-up steps."""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics, run_cli, run_torchrun, tiny_config
from hfsdp.config.schema import CompileConfig, TrainConfig


def test_compile_switch_and_mapping():
    base = {"output_dir": "x", "max_steps": 1}
    assert TrainConfig(**base).compile is None
    assert TrainConfig(**base, compile=False).compile is None
    assert TrainConfig(**base, compile=True).compile == CompileConfig(backend="inductor", mode=None)
    assert TrainConfig(**base, compile={"mode": "max-autotune-no-cudagraphs"}).compile.mode == "max-autotune-no-cudagraphs"
    with pytest.raises(ValueError, match="only applies to backend inductor"):
        TrainConfig(**base, compile={"backend": "aot_eager", "mode": "max-autotune"})
    assert TrainConfig(**base).chunked_loss is True


@pytest.mark.parametrize("sets, where, says", [
    (["fsdp.version=1", "train.compile=true"], "train.compile", "FSDP1"),
    (["train.compile={mode: reduce-overhead}"], "train.compile.mode", "needs a GPU"),
    (["model.attn_implementation=flash_attention_2"], "model.attn_implementation", "needs a CUDA GPU"),
    (["model.attn_implementation=flex_attention"], "model.attn_implementation", "no backward pass on CPU"),
    (["model.attn_implementation=flash"], "model.attn_implementation", "flash_attention_2"),
])
def test_refused_before_any_weight_loads(tmp_path, sets, where, says):
    config = tiny_config(tmp_path, model={"name_or_path": "someone/no-such-model"})  # a hub id, never looked up
    args = [x for s in sets for x in ("--set", s)]
    proc = run_cli("train", str(config), *args, check=False)
    assert proc.returncode == 2, proc.stderr
    line = next(line for line in proc.stderr.splitlines() if line.strip().startswith(where))
    assert says in line, proc.stderr
    assert "no-such-model" not in proc.stderr  # refused before the model was even looked up


def test_flash_attention_asks_for_16_bit_compute_and_its_package():
    """The GPU-only kernel's requirements, checked as a GPU run would check them (tests/test_gpu.py runs it)."""
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.rules.attention import attention_problems

    def problems(**fsdp):
        config = HfsdpConfig.model_validate({
            "model": {"name_or_path": "m", "attn_implementation": "flash_attention_2"},
            "data": {"path": "d.jsonl"}, "train": {"output_dir": "o", "max_steps": 1}, "fsdp": fsdp})
        return " ".join(msg for _, msg in attention_problems(config, on_cpu=False))

    import importlib.util

    installed = importlib.util.find_spec("flash_attn") is not None
    assert ("pip install flash-attn" in problems(mixed_precision="bf16")) != installed
    assert "bf16/fp16 only" in problems() and "bf16/fp16 only" not in problems(mixed_precision="bf16")


# ---- real runs: the same packed steps eager and compiled

COMMON = {"train": {"max_steps": 6, "eval_at_start": False, "export_final": False},
          "fsdp": {"activation_checkpointing": True}, "plugins": ["packing"], "packing": {"max_len": 256}}
# 2 ranks of 1 row each: the global batch of one process of 2 rows; aot_eager (traced, no code generation) keeps
# the 2-rank run affordable on 2 cores
RUNS = {"eager": (1, {}), "inductor": (1, {"compile": True}),
        "fsdp2_2ranks": (2, {"compile": {"backend": "aot_eager"}, "per_device_batch_size": 1})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (nproc, train) in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        config = tiny_config(folder, **{**COMMON, "train": {**COMMON["train"], **train}})
        proc = run_cli("train", str(config)) if nproc == 1 else run_torchrun(nproc, "train", str(config))
        out[name] = (proc, {m["step"]: m for m in read_metrics(folder / "run") if "loss" in m}, folder / "run")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["inductor", "fsdp2_2ranks"])
def test_compiled_blocks_train_the_eager_steps_without_recompiling(runs, name):
    proc, steps, run = runs[name]
    _, eager, _ = runs["eager"]
    report = json.loads((run / "startup_rank0.json").read_text())
    assert report["compiled_blocks"] == 2 and report["checkpointed_layers"] == 2  # smollm2-tiny's 2 layers
    assert "2 transformer blocks compiled in place" in proc.stdout
    assert sorted(steps) == sorted(eager) == list(range(1, 7))
    for step, m in eager.items():
        assert steps[step]["loss"] == pytest.approx(m["loss"], rel=1e-4, abs=1e-4), step
        assert steps[step]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-3), step
    graphs = [steps[s]["compile_graphs"] for s in sorted(steps)]
    # Compiled for real (graphs exist, none broken), and the warm-up steps compile every variant: the fixed shapes
    # of the first rows, then dynamic lengths; no step after the third compiles anything.
    assert graphs[0] >= 1 and all(steps[s]["compile_graph_breaks"] == 0 for s in steps), graphs
    assert graphs[2:] == [graphs[2]] * 4, graphs
    assert "compile_graphs" not in eager[1]
