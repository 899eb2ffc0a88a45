"""The real CLI as a fresh ``python -m hfsdp`` or a ``torchrun`` job would run it, each process forked from a server
that imported hfsdp's heavy dependencies once (about 7 s of every process's start on 2 cores).

``python tests/fork_server.py`` (started with the start-up environment of the calls it serves: :func:`startup_env`)
imports torch, transformers, accelerate, datasets, peft and hfsdp's training modules, then reads one JSON request a
line on stdin: ``{"module": "hfsdp", "argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path,
"nproc": N, "master_addr": ..., "master_port": ..., "scratch": path}``. For each it forks a job in a session of
its own, answers ``{"pid": PID}``, then ``{"returncode": N}`` once the job has exited.

* ``nproc`` 1: the job is ``python -m MODULE ARGV``: it changes to ``cwd``, takes ``env`` as its whole environment,
  writes to the two files, puts ``cwd`` first on ``sys.path`` and runs the module as ``__main__`` (:mod:`runpy`);
  it exits as the interpreter does (atexit handlers, an uncaught exception's traceback and exit 1).
* ``nproc`` N: the job is ``torchrun --nproc-per-node N -m MODULE ARGV`` (static rendezvous, one node): it forks
  the N ranks first, each with the environment torchrun gives its workers (:func:`rank_env`: RANK, LOCAL_RANK,
  WORLD_SIZE, ..., TORCHELASTIC_*; OMP_NUM_THREADS 1 unless set, with torchrun's notice), unbuffered as ``python
  -u`` (the server of a multi-rank job is started with PYTHONUNBUFFERED=1; the ranks' environment does not hold
  it), then hosts the agent's TCPStore on MASTER_PORT that torchrun's ranks join (TORCHELASTIC_USE_AGENT_STORE).
  When a rank fails it sends the others SIGTERM, then SIGKILL 30 s later, and ends with torchrun's
  ``ChildFailedError`` report (its failures, ``exitcode  : N`` each) and exit 1, as torchrun does.

What differs from a fresh process: the imports are done (a library's import-time reading of the environment is
the server's, hence one server per start-up environment, :func:`startup_env`), and what they made is frozen out of
the garbage collector's reach (``gc.freeze``: a job's collections, accelerate's ``gc.collect`` at the end of a
run and the interpreter's at exit, no longer walk half a million objects); a rank shares its job's process
group (torchrun gives each worker a session of its own), so that a timeout ends the job with one ``killpg``; the
launcher itself (elastic restarts, rendezvous backends, several nodes, signals sent to the launcher) is torchrun's
only in the tests that run real torchrun (tests/test_elastic.py, tests/test_multinode.py). The test
tests/test_launch.py runs the same config both ways and compares the runs and the ranks' environments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# Variables a launcher sets for each process (read at run time: the same server serves every rank and job).
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                            "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# Read at run time only: the launcher's, hfsdp's own (only its CLI and test plugins read HFSDP_*, after the fork) and
# pytest's (PYTEST_CURRENT_TEST changes with every test).
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "HFSDP_", "PYTEST_")
# hfsdp's CLI removes these before it imports Accelerate (hfsdp.parallel.launcher.take_launcher_settings): a
# server that imported Accelerate already would hide a regression there, so such calls start fresh processes.
FRESH_PREFIXES = ("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")
# What every server imports before serving: the libraries, then the modules an hfsdp run imports.
PRELOAD = ("torch", "transformers", "accelerate", "datasets", "peft", "safetensors.torch", "hfsdp.cli",
           "hfsdp.run.loop", "hfsdp.model.loading", "hfsdp.export.pipeline", "hfsdp.tools.plan.planner",
           "transformers.models.llama.modeling_llama", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor")
CLOSE_GRACE_S = 30  # torchrun's: SIGTERM to the other ranks, SIGKILL to those still running after it
OMP_NOTICE = ("*****************************************\n"
              "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
              "being overloaded, please further tune the variable for optimal performance in your application as "
              "needed. \n*****************************************")


def startup_env(env: Mapping[str, str], nproc: int) -> dict[str, str] | None:
    """The environment a server for this call starts with (the call's, less what is read at run time), or None where
    the call must be a fresh process."""
    if any(key.startswith(FRESH_PREFIXES) for key in env):
        return None
    start = {k: v for k, v in env.items() if k not in RANK_VARIABLES and not k.startswith(RUN_TIME_PREFIXES)}
    if nproc > 1:
        start.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for its workers
        start["PYTHONUNBUFFERED"] = "1"  # torchrun starts them with python -u
    return start


def rank_env(env: Mapping[str, str], local_rank: int, nproc: int, master_addr: str, master_port: int,
             error_dir: Path) -> dict[str, str]:
    """What torchrun (torch.distributed.run, static rendezvous on one node) gives worker ``local_rank``: the
    launching environment, OMP_NUM_THREADS 1 unless set, and its worker variables
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, multiprocessing/api.py)."""
    error_file = error_dir / "attempt_0" / str(local_rank) / "error.json"
    error_file.parent.mkdir(parents=True, exist_ok=True)
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
            "RANK": str(local_rank), "GROUP_RANK": "0", "ROLE_RANK": str(local_rank), "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "LOCAL_RANK": str(local_rank), "TORCHELASTIC_ERROR_FILE": str(error_file)}


# ---- the server (this file run as a script)


def serve() -> None:
    import gc
    import importlib

    sys.path.pop(0)  # this file's folder: a job puts its own working directory there, as python -m does
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made lives as long as a job does: out of the collector's reach, so that no job's collections
    # walk it again (what gc.freeze is for: a server that forks)
    gc.freeze()
    requests = sys.stdin.buffer.raw  # unbuffered: a forked job inherits no requests read ahead
    while line := requests.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _job(request)  # never returns
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _job(request: dict) -> None:
    os.setsid()  # the job and its ranks: one process group, ended together on a timeout
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    if request["nproc"] == 1:
        _become(request, request["env"])
    _agent(request)


def _become(request: dict, env: Mapping[str, str]) -> None:
    """This process becomes ``python -m MODULE ARGV`` in ``cwd`` with ``env``; it never returns (SystemExit or the
    module's own exception ends the interpreter as it would end a fresh one)."""
    import importlib
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    importlib.invalidate_caches()  # files written since the server started are found
    sys.path.insert(0, os.getcwd())
    sys.argv = ["-m", *request["argv"]]  # runpy puts the module's file first, as python -m does
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _log(level: str, message: str) -> None:
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
    print(f"{level}{stamp} {os.getpid()} torch/distributed/elastic/multiprocessing/api.py] {message}", file=sys.stderr,
          flush=True)


def _agent(request: dict) -> None:
    """torchrun's agent for one node: ranks forked first (no thread is started before they are), then the store."""
    from datetime import timedelta

    nproc, env = request["nproc"], dict(request["env"])
    if "OMP_NUM_THREADS" not in env:
        print(OMP_NOTICE, file=sys.stderr, flush=True)
    error_dir = Path(tempfile.mkdtemp(prefix="torchelastic_", dir=request["scratch"])) / "none_fork"
    ranks: dict[int, int] = {}  # pid -> local rank
    for local_rank in range(nproc):
        env_of_rank = rank_env(env, local_rank, nproc, request["master_addr"], request["master_port"], error_dir)
        pid = os.fork()
        if pid == 0:
            _become(request, env_of_rank)
        ranks[pid] = local_rank
    from torch.distributed import TCPStore

    running = dict(ranks)

    def forward(signum, _frame):  # torchrun passes a signal it receives on to its workers
        for pid in running:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        store = TCPStore(request["master_addr"], request["master_port"], is_master=True,  # noqa: F841 (kept open)
                         multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=900))
    except BaseException:
        forward(signal.SIGKILL, None)
        raise
    exits: dict[int, tuple[int, int]] = {}  # local rank -> (pid, exit code)
    closing_since = None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG if closing_since else 0)
        if pid:
            local_rank, code = running.pop(pid), os.waitstatus_to_exitcode(status)
            exits[local_rank] = (pid, code)
            if code != 0 and closing_since is None:
                _log("E", f"failed (exitcode: {code}) local_rank: {local_rank} (pid: {pid}) of binary: "
                          f"{sys.executable}")
                for other in running:
                    _log("W", f"Sending process {other} closing signal SIGTERM")
                    os.kill(other, signal.SIGTERM)
                closing_since = time.monotonic()
        elif time.monotonic() - closing_since > CLOSE_GRACE_S:
            forward(signal.SIGKILL, None)
        else:
            time.sleep(0.05)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=pid, exitcode=code,
                                     error_file=str(error_dir / "attempt_0" / str(rank) / "error.json"))
                for rank, (pid, code) in sorted(exits.items()) if code != 0}
    if failures:
        import traceback

        try:
            raise ChildFailedError(name=request["module"], failures=failures)
        except ChildFailedError:
            traceback.print_exc()  # as torchrun's uncaught error prints it
    sys.stderr.flush()
    os._exit(1 if failures else 0)  # the agent's own interpreter teardown (1.4 s of a 2-rank job) is not under test


# ---- the client (the tests' side)


class ForkServer:
    """A :func:`serve` process for one start-up environment; :meth:`run` is one call, one at a time."""

    def __init__(self, startup: Mapping[str, str], scratch: Path):
        self.startup = dict(startup)
        self.scratch = scratch  # each call's stdout and stderr, and its ranks' error-file folders
        # its own output (what its imports print, a crash) in a file of its own, shown when it fails
        self.log = Path(tempfile.mkstemp(dir=scratch, prefix="server-", suffix=".log")[1])
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, __file__], env=self.startup, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log)

    def run(self, module: str, argv: list[str], cwd: Path, env: Mapping[str, str], nproc: int, timeout: float,
            master_port: int = 0) -> tuple[int, str, str]:
        """(returncode, stdout, stderr) of the call; subprocess.TimeoutExpired (the job killed) past ``timeout``."""
        import select

        out, err = (self._scratch_file(suffix) for suffix in (".out", ".err"))
        request = {"module": module, "argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env),
                   "stdout": str(out), "stderr": str(err), "nproc": nproc, "master_addr": "127.0.0.1",
                   "master_port": master_port, "scratch": str(self.scratch)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        job = json.loads(self._answer(timeout=600))["pid"]  # the server's imports may still be running
        deadline = time.monotonic() + timeout
        timed_out = not select.select([self.proc.stdout], [], [], timeout)[0]
        if timed_out:
            os.killpg(job, signal.SIGKILL)  # the job and its ranks
        code = json.loads(self._answer(timeout=max(60.0, deadline - time.monotonic())))["returncode"]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return code, stdout, stderr

    def _answer(self, timeout: float) -> str:
        import select

        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.proc.kill()
            raise RuntimeError(f"tests/fork_server.py did not answer in {timeout:.0f} s\n{self._log_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/fork_server.py exited {self.proc.wait()} before answering\n{self._log_tail()}")
        return line.decode()

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def _scratch_file(self, suffix: str) -> Path:
        fd, path = tempfile.mkstemp(dir=self.scratch, suffix=suffix)
        os.close(fd)  # the job opens it by name
        return Path(path)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.unlink(missing_ok=True)


class ForkServers:
    """The servers of one test process, by start-up environment. A start-up environment's first call runs as a fresh
    process (a server costs the imports of a fresh process, and most one-off environments, a test's own plugin
    folder on PYTHONPATH, are never seen again); from its second call on, calls take an idle server or start one
    (calls from several threads get several). At most ``keep`` idle servers stay, the least recently used closed
    first."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.idle: list[ForkServer] = []
        self.seen: set[tuple] = set()
        self.lock = threading.Lock()
        self.scratch = Path(tempfile.mkdtemp(prefix="hfsdp-fork-"))

    def run(self, module: str, argv: list[str], cwd: Path, env: Mapping[str, str], nproc: int, timeout: float,
            master_port: int = 0, first_fresh: bool = True) -> tuple[int, str, str] | None:
        """As :meth:`ForkServer.run`, or None where the call is to be a fresh process (:func:`startup_env`, or the
        environment's first call unless ``first_fresh`` is false)."""
        startup = startup_env(env, nproc)
        if startup is None:
            return None
        key = tuple(sorted(startup.items()))
        with self.lock:
            if key not in self.seen and first_fresh:
                self.seen.add(key)
                return None
            server = next((s for s in reversed(self.idle) if s.startup == startup and s.proc.poll() is None), None)
            if server is not None:
                self.idle.remove(server)
        server = server or ForkServer(startup, self.scratch)
        try:
            result = server.run(module, argv, cwd, env, nproc, timeout, master_port)
        except subprocess.TimeoutExpired:
            self._keep(server)  # the job was killed and reaped: the server serves on
            raise
        except BaseException:
            server.proc.kill()
            raise
        self._keep(server)
        return result

    def _keep(self, server: ForkServer) -> None:
        with self.lock:
            self.idle.append(server)
            while len(self.idle) > self.keep:
                self.idle.pop(0).close()

    def close(self) -> None:
        import shutil

        with self.lock:
            for server in self.idle:
                server.close()
            self.idle.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)


if __name__ == "__main__":
    serve()
