"""``--overwrite`` and ``--resume`` never lose the run already in ``train.output_dir``: what they replace or rewrite
is set aside until the new run's first step (hfsdp.disk.aside), and put back, byte for byte, when the new run stops
before it: a failed check (bad data, a missing model, a rule only the launched world or the model can check, a NaN
in the first step on 2 ranks), a signal, or a kill -9 (put back by the next command that touches the folder).

One finished 2-step run (a checkpoint each step, final/, metrics, tensorboard) is made per module; each test starts
from a copy of it. The lock file is the one thing a new run rewrites for good (it names the run that holds it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import run_cli, tiny_config
from test_reliability import error_line, fault_env, no_traceback, snapshot, train

ASIDE = ".hfsdp-earlier-run"


def fault_config(tmp_path: Path, **sections) -> Path:
    sections = {"plugins": ["hfsdp_faults"], **sections}
    sections["train"] = {"max_steps": 2, "save_every": 1, **sections.get("train", {})}
    return tiny_config(tmp_path, **sections)


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("earlier")
    run_cli("train", str(fault_config(folder)), env=fault_env())
    return folder / "run"


def files(run: Path) -> dict[str, bytes]:
    """Every file of the run folder, by path, without the lock file."""
    return {name: data for name, data in snapshot(run).items() if name != ".hfsdp-run.lock"}


def copy_of(earlier: Path, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    run = tmp_path / "run"
    shutil.copytree(earlier, run)
    return run, files(run)


BROKEN_ROW = '{"messages": [{"role": "user", "content": "cut sh'


def assert_put_back(proc, run: Path, before: dict[str, bytes], exit_code: int = 2, set_aside: bool = True) -> None:
    """``proc`` stopped with ``exit_code`` and no traceback, and ``run`` holds the earlier run as it was (put back,
    saying so, where ``set_aside``: the new run had prepared the folder)."""
    assert proc.returncode == exit_code, proc.stderr[-4000:]
    no_traceback(proc)
    back = f"hfsdp: {run}: the earlier run is back as it was (this run stopped before its first step, so nothing " \
           "of it was removed)"
    assert (back in proc.stderr) == set_aside, proc.stderr[-3000:]
    assert files(run) == before
    assert not (run / ASIDE).exists()


# Each way a new run can fail before its first step on one process: the --set that makes it, what it says, and
# whether the folder was prepared (the earlier run set aside) before the failure
FAILURES = {
    "bad data": ("data.path={tmp}/broken.jsonl", "broken.jsonl, line 1: Unterminated string", True),
    "a model folder without its weights": ("model.name_or_path={tmp}/no-weights",
                                           "cannot load the weights of", True),
    "a hub model offline": ("model.name_or_path=someone/a-model",
                            "is a hub id that is not in the local Hugging Face cache", True),
    "a misspelt model name": ("model.name_or_path=smollm2-tinny", "did you mean smollm2-tiny?", False),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_an_overwrite_that_fails_before_its_first_step_leaves_the_earlier_run_byte_identical(
        case, earlier, tmp_path, tiny_model_dir):
    run, before = copy_of(earlier, tmp_path)
    (tmp_path / "broken.jsonl").write_text(BROKEN_ROW + "\n")
    shutil.copytree(tiny_model_dir, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors"))
    change, says, set_aside = FAILURES[case]
    proc = train(fault_config(tmp_path), "", "--overwrite", "--set", change.format(tmp=tmp_path))
    assert_put_back(proc, run, before, set_aside=set_aside)
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line]
    assert len(errors) == 1 and says in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_an_overwrite_on_2_ranks_that_a_model_rule_or_its_first_step_stops_leaves_the_earlier_run_byte_identical(
        earlier, tmp_path):
    """sp_size 2 on SmolLM2-135M (9 heads): a rule of the launched world and the model's config, refused before the
    folder is touched (nothing set aside, nothing said of putting it back); a NaN in rank 1's first forward
    (on_nonfinite: stop), after the earlier run was set aside: put back."""
    run, before = copy_of(earlier, tmp_path)
    proc = train(fault_config(tmp_path), "", "--overwrite", "--set", "model.name_or_path=smollm2-135m-instruct",
                 "--set", "parallel.sp_size=2", nproc=2)
    assert proc.returncode != 0 and "2 does not divide the model's num_attention_heads (9)" in proc.stderr
    assert files(run) == before and not (run / ASIDE).exists()
    assert "the earlier run is back" not in proc.stderr, proc.stderr[-3000:]

    proc = train(fault_config(tmp_path, train={"on_nonfinite": "stop"}), "nan@1:1", "--overwrite", nproc=2)
    assert proc.returncode != 0 and "step 1" in error_line(proc), proc.stderr[-3000:]
    assert files(run) == before and not (run / ASIDE).exists()
    assert f"hfsdp: {run}: the earlier run is back as it was" in proc.stderr, proc.stderr[-3000:]


def test_sigterm_before_the_first_step_puts_the_earlier_run_back_and_exits_143(earlier, tmp_path):
    run, before = copy_of(earlier, tmp_path)
    proc = train(fault_config(tmp_path), "sigterm@0", "--overwrite")  # at the train start: all loaded and written
    assert_put_back(proc, run, before, exit_code=143)
    assert proc.stderr.rstrip().endswith("hfsdp: stopped by SIGTERM"), proc.stderr[-2000:]


def test_a_resume_stopped_before_its_first_step_leaves_the_metrics_and_config_it_rewrote_as_they_were(
        earlier, tmp_path):
    """Resuming from step 1 drops step 2's records from metrics.jsonl and rewrites config.yaml (a changed
    train.log_every) before the first step: a SIGTERM there puts both back."""
    run, before = copy_of(earlier, tmp_path)
    proc = train(fault_config(tmp_path, train={"log_every": 2}), "sigterm@0", f"--resume={run}/checkpoints/step-1")
    assert_put_back(proc, run, before, exit_code=143)


def test_a_kill_9_before_the_first_step_leaves_the_earlier_run_aside_and_the_next_command_puts_it_back(
        earlier, tmp_path):
    run, before = copy_of(earlier, tmp_path)
    config = fault_config(tmp_path)
    proc = train(config, "sigkill@0", "--overwrite")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (run / ASIDE).is_dir() and files(run) != before  # the killed run's metrics.jsonl, config.yaml...
    again = train(config, "")  # the next command into the folder, without --overwrite: refused, the run back
    assert again.returncode == 2 and "already holds a run" in error_line(again), again.stderr[-3000:]
    assert f"hfsdp: {run}: put back the earlier run that a run killed before its first step (pid " in again.stderr
    assert files(run) == before and not (run / ASIDE).exists()


def test_a_good_overwrite_replaces_the_earlier_run(earlier, tmp_path):
    run, before = copy_of(earlier, tmp_path)
    proc = train(fault_config(tmp_path, train={"max_steps": 1}), "", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "earlier run is back" not in proc.stderr
    after = files(run)
    assert not (run / ASIDE).exists() and not (run / f"{ASIDE}.dropped").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    assert after["metrics.jsonl"] != before["metrics.jsonl"] and '"step": 2' not in after["metrics.jsonl"].decode()


def test_an_export_overwrite_killed_midway_leaves_the_earlier_export_byte_identical(earlier, tmp_path):
    out = tmp_path / "out"
    source = earlier / "checkpoints" / "step-2"
    run_cli("export", str(source), str(out), env=fault_env())
    before = snapshot(out)
    proc = run_cli("export", str(earlier / "checkpoints" / "step-1"), str(out), "--overwrite",
                   env=fault_env("sigkill_export@0"), check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert snapshot(out) == before
    again = run_cli("export", str(earlier / "checkpoints" / "step-1"), str(out), "--overwrite", env=fault_env())
    assert "that was stopped midway" in again.stdout and snapshot(out) != before
