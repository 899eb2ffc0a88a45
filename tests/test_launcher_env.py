"""The hfsdp YAML decides FSDP: settings a launcher leaves in the environment are named, ignored, and lose."""

import json

import pytest
from conftest import base_env, run_cli, tiny_config


@pytest.mark.slow
def test_conflicting_launcher_settings_are_reported_and_ignored(tmp_path):
    config = tiny_config(tmp_path, train={"max_steps": 1, "eval_at_start": False},
                         fsdp={"version": 2, "single_process": "fsdp"})
    env = base_env(FSDP_SHARDING_STRATEGY="NO_SHARD", FSDP_VERSION="1", ACCELERATE_MIXED_PRECISION="bf16",
                   ACCELERATE_USE_FSDP="true")
    proc = run_cli("train", str(config), env=env)
    assert "launcher setting FSDP_SHARDING_STRATEGY=NO_SHARD ignored" in proc.stderr
    assert "launcher setting FSDP_VERSION=1 ignored" in proc.stderr
    assert "launcher setting ACCELERATE_MIXED_PRECISION=bf16 ignored" in proc.stderr
    assert "ACCELERATE_USE_FSDP" not in proc.stderr  # consistent with an FSDP config: nothing to report
    report = json.loads((tmp_path / "run" / "startup_rank0.json").read_text())
    assert (report["fsdp_version"], report["strategy"], report["mixed_precision"]) == (2, "FULL_SHARD", "no")
    assert report["distributed_type"] == "FSDP"


# Every ACCELERATE_* variable Accelerate reads that changes the math (from accelerate's source), with a value that
# would change this run if it got through; the CLI removes them all (issue 15 item 4).
MATH_CHANGING = {
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",  # accelerator.backward() divides the loss by it
    "ACCELERATE_GRADIENT_CLIPPING": "0.01",
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_DOWNCAST_BF16": "true",
    "ACCELERATE_DYNAMO_BACKEND": "aot_eager",
    "ACCELERATE_DYNAMO_MODE": "reduce-overhead",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "true",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
    "ACCELERATE_USE_CPU": "true",  # removed too; no note on a CPU host, where hfsdp runs on the CPU anyway
    "ACCELERATE_TORCH_DEVICE": "meta",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_TP_SIZE": "2",
    "ACCELERATE_INIT_INCLUDE_BUFFERS": "true",
    "ACCELERATE_FP8_BACKEND": "TE",
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_USE_MEGATRON_LM": "true",
}


@pytest.mark.slow
def test_accelerate_variables_that_change_the_math_are_removed(tmp_path):
    def run(name: str, **env: str) -> tuple[list[tuple[float, float]], str]:
        folder = tmp_path / name
        folder.mkdir()
        config = tiny_config(folder, train={"max_steps": 2, "eval_at_start": False},
                             data={"eval_path": None})
        proc = run_cli("train", str(config), env=base_env(**env))
        metrics = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        return [(m["loss"], m["grad_norm"]) for m in metrics if "loss" in m], proc.stderr

    clean, _ = run("clean")
    polluted, stderr = run("polluted", **MATH_CHANGING)
    assert len(clean) == 2 and polluted == clean  # identical losses and grad norms, bit for bit
    for key, value in MATH_CHANGING.items():
        if key != "ACCELERATE_USE_CPU":
            assert f"launcher setting {key}={value} ignored" in stderr, (key, stderr[-3000:])
    assert "ACCELERATE_USE_CPU" not in stderr
