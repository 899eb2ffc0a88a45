"""The hfsdp YAML decides FSDP: settings a launcher leaves in the environment are named, ignored, and lose."""

import json

import pytest
from conftest import base_env, run_cli, tiny_config


@pytest.mark.slow
def test_conflicting_launcher_settings_are_reported_and_ignored(tmp_path):
    config = tiny_config(tmp_path, train={"max_steps": 1, "eval_at_start": False}, fsdp={"version": 2})
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
