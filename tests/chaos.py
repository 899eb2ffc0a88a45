"""Chaos: a whole training job (the torchrun launcher and every rank) killed with SIGKILL at seeded random moments,
started again with the same command line (``hfsdp train CONFIG --resume``), until the run finishes (:func:`campaign`).

A kill is a :class:`Kill`: once the attempt has ended ``after_steps`` optimizer steps (0: from the launch, in its
start-up), wait ``delay_s`` more, then SIGKILL the job's process group. ``after_steps`` is capped at the steps the
attempt has left (:data:`LAST`: after the last step: the final eval, the export, the summary). The schedule is a
pure function of a seed (:func:`schedule`): a failure names its seed and reproduces with it. Steps are counted in
the file the test fault plugin writes (``HFSDP_TEST_PROGRESS``, tests/fault_plugin/hfsdp_faults.py), so the run
needs ``plugins: [hfsdp_faults]`` and tests/fault_plugin on PYTHONPATH (it changes nothing else).

Each attempt is classified by what the kill interrupted (:func:`interrupted`): start-up, steps, a save (a
``.tmp-step-N`` folder on disk), the export (a ``.final.tmp-*`` folder), or nothing (the attempt had finished).
Used by tests/test_chaos.py and benchmarks/chaos_campaign.py.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hfsdp.parallel.launcher import free_port

FAULT_PLUGIN = Path(__file__).resolve().parent / "fault_plugin"
FINISHED = "nothing (finished)"  # what a kill interrupted when the job had ended before its moment


@dataclass(frozen=True)
class Kill:
    after_steps: int
    delay_s: float


# after_steps of the last kill: capped at the steps left, it lands after the run's last step
LAST = 10**6


def schedule(seed: int, kills: int, startup_s: float = 10.0, step_s: float = 0.6, tail_s: float = 0.4) -> list[Kill]:
    """``kills`` kills (at least 2) drawn from ``seed``: the first in the start-up (0 steps, up to ``startup_s``: the
    model loading, the data, the process group), the last after the run's last step (up to ``tail_s``: the final
    eval, the export, the summary), the others after 1 or 2 steps and up to ``step_s`` into what follows (the next
    step, its sampling, the save of the step just ended, an async write)."""
    rng = random.Random(seed)
    middle = [Kill(rng.choice([1, 2]), round(rng.uniform(0, step_s), 3)) for _ in range(kills - 2)]
    return [Kill(0, round(rng.uniform(0, startup_s), 3)), *middle, Kill(LAST, round(rng.uniform(0, tail_s), 3))]


@dataclass
class Attempt:
    number: int
    kill: Kill | None
    returncode: int
    steps: list[int]  # the optimizer steps this attempt ended
    interrupted: str  # what the kill interrupted ("" when it was not killed)
    seconds: float
    log: Path


@dataclass
class Campaign:
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def kills(self) -> list[Attempt]:
        return [a for a in self.attempts if a.interrupted and a.interrupted != FINISHED]

    def describe(self) -> str:
        return "; ".join(f"#{a.number} {a.interrupted or 'ran to the end'} (steps {a.steps or '-'}, rc "
                         f"{a.returncode}, {a.seconds:.1f} s)" for a in self.attempts)


def torchrun(nproc: int, config: Path) -> list[str]:
    """The job: real torchrun (its launcher and workers, one process group) running ``hfsdp train CONFIG --resume``,
    a fresh local port for each attempt."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "hfsdp", "train", str(config), "--resume"]


def interrupted(run_dir: Path, steps: int, left: int) -> str:
    """What a kill interrupted, read from what it left on disk and the steps the attempt had ended."""
    if any((run_dir / "checkpoints").glob(".tmp-step-*")):
        return "a save"
    if any(run_dir.glob(".final.tmp-*")):
        return "the export"
    if steps == 0:
        return "start-up"
    return "after the last step" if steps >= left else "steps"


def latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (where ``--resume`` continues), 0 without one."""
    done = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*") if (p / "hfsdp_checkpoint.json").is_file()]
    return max(done, default=0)


def campaign(nproc: int, config: Path, run_dir: Path, max_steps: int, kills: list[Kill], env: dict[str, str],
             logs: Path, attempt_timeout: float = 600, max_attempts: int | None = None) -> Campaign:
    """Run the job, killing each attempt as ``kills`` say, then once more to the end (exit 0); every attempt's
    console is kept in ``logs``. Raises with the attempts so far when an attempt fails on its own or the run does
    not finish within ``max_attempts`` (default: the kills and 3 more)."""
    logs.mkdir(parents=True, exist_ok=True)
    result = Campaign()
    limit = max_attempts or len(kills) + 3
    for number in range(limit):
        kill = kills[number] if number < len(kills) else None
        progress = logs / f"progress-{number}.txt"
        progress.write_text("")
        log = logs / f"attempt-{number}.log"
        left = max_steps - latest_step(run_dir)
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(torchrun(nproc, config), env={**env, "HFSDP_TEST_PROGRESS": str(progress)},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            what = ""
            try:
                if kill is not None:
                    what = _kill_when(proc, progress, kill, left, run_dir, started + attempt_timeout)
                proc.wait(timeout=max(1.0, started + attempt_timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_job(proc)
                raise AssertionError(f"attempt {number} ran past {attempt_timeout} s; {result.describe()}\n"
                                     f"{log.read_text()[-4000:]}") from None
            except BaseException:  # the harness itself stopped (Ctrl-C, SIGTERM): no job left running
                kill_job(proc)
                raise
        steps = [int(s) for s in progress.read_text().split()]
        result.attempts.append(Attempt(number, kill, proc.returncode, steps, what, time.monotonic() - started, log))
        if not what or what == FINISHED:
            if proc.returncode != 0:
                raise AssertionError(f"attempt {number} failed by itself (exit {proc.returncode}); "
                                     f"{result.describe()}\n{log.read_text()[-6000:]}")
            return result
    raise AssertionError(f"the run did not finish in {limit} attempts: {result.describe()}")


def _kill_when(proc: subprocess.Popen, progress: Path, kill: Kill, left: int, run_dir: Path, deadline: float) -> str:
    """Wait for the kill's moment and SIGKILL the whole job then; what it interrupted (:data:`FINISHED` when the
    job had ended first)."""
    after = min(kill.after_steps, left)
    while len(progress.read_text().split()) < after:
        if proc.poll() is not None or time.monotonic() > deadline:
            return FINISHED if proc.poll() is not None else ""
        time.sleep(0.02)
    end = time.monotonic() + kill.delay_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return FINISHED
        time.sleep(0.01)
    if proc.poll() is not None:
        return FINISHED
    what = interrupted(run_dir, len(progress.read_text().split()), left)
    kill_job(proc)
    return what


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (torchrun starts its workers in sessions of their own: its
    process group alone would leave them running), then reap the launcher."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for each in tree:
        try:
            each.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree[1:], timeout=30)
