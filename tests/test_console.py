"""A quiet console: the tiny preset and an export print no warning a user cannot act on; --verbose shows them."""

from __future__ import annotations

import shutil

import pytest

from conftest import PRESET_DATA, base_env, run_cli, tiny_config
from hfsdp import __version__


def _warning_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if "Warning" in line]


@pytest.mark.slow
def test_tiny_preset_and_export_print_no_warnings(tmp_path):
    env = base_env()
    env.pop("OMP_NUM_THREADS")  # unset, as for a user: Accelerate would warn that it set it
    train = run_cli("train", "tiny", "--set", "train.max_steps=4", "--set", "train.save_every=4", cwd=tmp_path, env=env)
    assert _warning_lines(train.stderr) == [] and _warning_lines(train.stdout) == []
    assert "throughput: median" in train.stdout
    # the checkpoint of a model with tied embeddings keeps one of the two: Accelerate's note on it is hfsdp's to know
    assert "Removed shared tensor" not in train.stdout + train.stderr, train.stderr[-2000:]

    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step-4"
    export = run_cli("export", str(checkpoint), str(tmp_path / "out"), env=env)
    assert _warning_lines(export.stderr) == [], export.stderr


@pytest.mark.parametrize("verbose, shown", [(False, ["check your data"]),
                                            (True, ["OMP_NUM_THREADS/MKL_NUM_THREADS unset", "old", "check your data"])])
def test_only_warnings_a_user_can_act_on_are_shown_unless_verbose(verbose, shown):
    import warnings

    from hfsdp.quiet import hide_library_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not verbose:  # what the CLI does
            hide_library_warnings()
        warnings.warn("OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 2 to improve oob performance.", UserWarning)
        warnings.warn("old", FutureWarning)
        warnings.warn("check your data", UserWarning)
    assert [str(w.message).split(",")[0] for w in caught] == shown


@pytest.mark.slow
def test_a_first_run_shows_one_bar_per_phase_and_says_what_runs(tmp_path):
    """On a preprocessing cache miss (data never seen: fresh copies) datasets' own bars ("Generating train split",
    "Saving the dataset") are hidden beside hfsdp's tokenizing and training bars, and the start-up line says what
    runs in words, not Accelerate's distributed type ("NO on cpu")."""
    for name in ("contacts_train.jsonl", "contacts_eval.jsonl"):
        shutil.copy(PRESET_DATA / name, tmp_path / name)
    config = tiny_config(tmp_path, data={"path": str(tmp_path / "contacts_train.jsonl"),
                                         "eval_path": str(tmp_path / "contacts_eval.jsonl")}, train={"max_steps": 2})
    proc = run_cli("train", str(config))
    bars = {line.split(":")[0] for line in proc.stderr.replace("\r", "\n").splitlines() if "%|" in line or "it/s" in line
            or "examples/s" in line}
    assert "preprocessing cache hit" not in proc.stdout  # the datasets bars only show on a miss
    assert {"tokenizing train", "tokenizing eval", "training"} <= bars, bars  # one bar per split (and per source)
    assert not {b for b in bars if b.startswith(("Generating", "Saving the dataset", "Loading dataset"))}, bars
    assert f"hfsdp {__version__} | 1 process on cpu, no wrapper\n" in proc.stdout, proc.stdout[:500]
    assert "NO on cpu" not in proc.stdout
