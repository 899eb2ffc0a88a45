"""A quiet console: the tiny preset and an export print no warning a user cannot act on; --verbose shows them."""

from __future__ import annotations

import pytest

from conftest import base_env, run_cli

pytestmark = pytest.mark.slow


def _warning_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if "Warning" in line]


def test_tiny_preset_and_export_print_no_warnings(tmp_path):
    env = base_env()
    env.pop("OMP_NUM_THREADS")  # unset, as for a user: Accelerate would warn that it set it
    train = run_cli("train", "tiny", "--set", "train.max_steps=4", "--set", "train.save_every=4", cwd=tmp_path, env=env)
    assert _warning_lines(train.stderr) == [] and _warning_lines(train.stdout) == []
    assert "throughput: median" in train.stdout

    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step-4"
    export = run_cli("export", str(checkpoint), str(tmp_path / "out"), env=env)
    assert _warning_lines(export.stderr) == [], export.stderr
    # the hidden warnings are still there for who asks: DCP's single-process note on a SHARDED checkpoint
    verbose = run_cli("--verbose", "export", str(checkpoint), str(tmp_path / "out2"), env=env)
    assert any("torch.distributed is disabled" in line for line in _warning_lines(verbose.stderr)), verbose.stderr
