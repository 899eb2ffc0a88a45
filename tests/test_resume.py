"""What a resume must continue: the LR schedule the run started with, on the data it started with (issue 15 item 5).

One short cosine run saves a checkpoint; resumes that would change its schedule or its data are refused (exit 2, one
message) before anything trains."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import PRESET_DATA, run_cli, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    rows = folder / "rows.jsonl"
    shutil.copy(PRESET_DATA / "contacts_train.jsonl", rows)
    config = tiny_config(folder, data={"path": str(rows), "eval_path": None},
                         train={"max_steps": 2, "save_every": 2, "lr_scheduler": "cosine", "eval_at_start": False,
                                "export_final": False})
    run_cli("train", str(config))
    record = json.loads((folder / "run" / "checkpoints" / "step-2" / "hfsdp_checkpoint.json").read_text())
    return folder, config, rows, record


def _refused(config, *args) -> str:
    proc = run_cli("train", str(config), "--resume", *args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hfsdp: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


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
