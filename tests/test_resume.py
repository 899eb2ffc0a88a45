"""What a resume must continue: the LR schedule the run started with, on the data it started with (issue 15 item 5).

One short cosine run saves a checkpoint; resumes that would change its config, its schedule or its data are refused
(exit 2, one message) before any weight loads: the test plugin ``hfsdp_model_loads`` counts the loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import PRESET_DATA, base_env, run_cli, tiny_config

pytestmark = pytest.mark.slow
ENV = base_env(PYTHONPATH=str(Path(__file__).resolve().parent / "fault_plugin"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    rows = folder / "rows.jsonl"
    shutil.copy(PRESET_DATA / "contacts_train.jsonl", rows)
    config = tiny_config(folder, data={"path": str(rows), "eval_path": None},
                         train={"max_steps": 2, "save_every": 2, "lr_scheduler": "cosine", "eval_at_start": False,
                                "export_final": False}, plugins=["hfsdp_model_loads"])
    run_cli("train", str(config), env=ENV)
    assert _loads(folder) == 1
    record = json.loads((folder / "run" / "checkpoints" / "step-2" / "hfsdp_checkpoint.json").read_text())
    return folder, config, rows, record


def _loads(folder) -> int:
    """How many times a rank of the runs in ``folder`` got as far as loading the model's weights."""
    return len((folder / "run" / "model_loads.txt").read_text().splitlines())


def _refused(config, *args) -> str:
    proc = run_cli("train", str(config), "--resume", *args, check=False, env=ENV)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hfsdp: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert _loads(config.parent) == 1, "a refused resume loaded the model's weights"
    return errors[0]


def test_resume_with_a_changed_config_key_is_refused_before_the_data_and_the_model_load(saved):
    folder, config, _, _ = saved
    proc = run_cli("train", str(config), "--resume", "--set", "train.learning_rate=0.1", check=False, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot resume from" in proc.stderr and "the config changed in keys that change the run" in proc.stderr
    assert "data:" not in proc.stdout and _loads(folder) == 1  # refused before the data was read


def test_resume_with_another_length_keeps_the_schedule_or_is_refused(saved):
    folder, config, _, record = saved
    assert record["max_steps"] == 2
    message = _refused(config, "--set", "train.max_steps=4")
    assert "its cosine LR schedule runs over 2 steps, this run's over 4" in message
    assert "use lr_scheduler: constant to extend a run" in message
    assert sorted(p.name for p in (folder / "run" / "checkpoints").iterdir()) == ["step-2"]


def test_resume_on_other_data_is_refused(saved):
    folder, config, rows, record = saved
    assert record["train_rows"] > 0 and len(record["train_fingerprint"]) == 16
    lines = rows.read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[:-1]))  # the same file, one row shorter
    try:
        message = _refused(config)
    finally:
        rows.write_text("".join(lines))
    assert f"it was trained on other data ({record['train_rows']} rows" in message
    assert f"this run's data: {record['train_rows'] - 1} rows" in message
