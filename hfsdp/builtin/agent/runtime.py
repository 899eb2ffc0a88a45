"""The tool runtime of the online objectives' rollouts, torch-free: the tools and environments a config names run in
processes of their own, never in the training process, and answer as TRL's GRPOTrainer answers (``tools=``,
``environment_factory=``, its ``_tool_call_loop``).

* :func:`describe` imports the named tools and environments in a process of its own (under the :class:`Limits`) and
  returns what the prompts and the rollout loop need (:class:`Toolset`: the JSON schemas, per environment, in TRL's
  order; which tools are coroutines; which environments own a reward), or :class:`ToolsetError` with every problem
  by config key and how to fix it.
* :class:`ToolWorkers` runs one rank's rollouts: a process per rollout (kept and reused across rounds) that holds
  its environment (constructed once, reset every round), runs its tool calls (the rollouts' at the same time, one
  rollout's in order) under a wall-clock, memory and CPU limit, and reads its reward. A call that fails is the
  error TRL would put in the tool message (``{'error': ...}``), with texts that never hold a process id, a time
  measured or an address: the same calls give the same tokens on every run, world size and resume. A process that
  dies (segfault, ``os._exit``, SIGKILL, a limit) is replaced, and its environment brought back by replaying the
  rollout's reset and earlier calls.

Tool processes run ``sys.executable`` with the trainer's environment variables, working directory and ``sys.path``
(``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` default to 1 there: a process per rollout),
import neither torch nor transformers (:func:`describe`'s process imports transformers' schema writer), and die with
the process that started them (``PR_SET_PDEATHSIG``, and a pipe whose end takes their process group with them):
create and use :class:`ToolWorkers` from the trainer's main thread, which the kernel watches. hfsdp's built-in tool
and environment ``python`` (:data:`BUILTIN_TOOLS`, :data:`BUILTIN_ENVIRONMENTS`) are :mod:`~hfsdp.builtin.agent.sandbox`'s.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import math
import numbers
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

BUILTIN_TOOLS = {"python": "hfsdp.builtin.agent.sandbox:python"}
"""hfsdp's tools, by the bare name a config gives them."""
BUILTIN_ENVIRONMENTS = {"python": "hfsdp.builtin.agent.sandbox:PythonSandbox"}
"""hfsdp's environments, by the bare name a config gives them."""
RESULT_LIMIT = 1 << 20
"""Bytes (UTF-8) of a tool result's text; a longer one is the call's error (``too_long``)."""
START_TIMEOUT_S = 60.0
"""Seconds a tool process has to start: the interpreter, then the tools' and environments' modules."""
ASYNC_GRACE_S = 1.0
"""Seconds past ``timeout_s`` before a rollout's async calls are stopped with their process: a coroutine that does
not return in time is cancelled in the process first (the others' results stay); one that blocks its event loop is
not."""
FAILURES = ("raised", "timeout", "crashed", "memory", "cpu", "unknown_tool", "too_long", "lost")
"""The ways a tool call fails (:meth:`ToolWorkers.call`)."""
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds this hfsdp, first on a tool process's path
_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Limits:
    """What one tool process may use."""

    timeout_s: float
    """Wall clock of one call (reset, tool call, get_reward), in seconds: then its process is killed."""
    memory_mb: int
    """Address space of the process (``RLIMIT_AS``), in MiB: past it, Python raises MemoryError."""
    cpu_s: float
    """CPU time of one call, in seconds (``RLIMIT_CPU``: SIGXCPU kills the process)."""


@dataclass(frozen=True)
class Toolset:
    """What :func:`describe` found: plain data, picklable. An environment's key is its name in the config's mapping,
    or None (one environment for every row, or none: then the key None holds the standalone tools)."""

    tools: tuple[str, ...]
    """The standalone tools, in the config's order, as ``module:function`` (a built-in's bare name resolved)."""
    environments: dict[str | None, str]
    """{} for none; {None: "module:Class"} for one environment of every row; {name: "module:Class"} for a mapping
    (the rows name theirs in an ``environment`` column)."""
    schemas: dict[str | None, list[dict]]
    """Per environment, the JSON schemas (``transformers.utils.get_json_schema``) of the standalone tools, then of the
    environment's public methods (``inspect.getmembers`` of its class: by name, ``reset``, ``get_reward`` and names
    that start with ``_`` left out), as TRL renders them into the prompt."""
    asynchronous: dict[str | None, frozenset[str]]
    """Per environment, the names of the tools that are coroutine functions (TRL appends their results after the
    others')."""
    rewarded: dict[str | None, str | None]
    """Per environment, its class's ``__name__`` when the class defines ``get_reward`` (TRL's name of that reward),
    else None."""

    def names(self, environment: str | None) -> list[str]:
        """The tool names of ``environment``'s rollouts, in schema order."""
        return [schema["function"]["name"] for schema in self.schemas[environment]]


class ToolsetError(Exception):
    """What is wrong with a config's tools and environments: ``problems``, every one as (config key, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("\n".join(f"{key}: {message}" for key, message in problems))
        self.problems = problems


class RolloutError(Exception):
    """An environment's reset or get_reward that failed (raised, hung, crashed its process), or a tool process that
    could not start: the run stops with this message."""


def describe(tools: list[str], environment: str | dict[str, str] | None, limits: Limits, section: str) -> Toolset:
    """The :class:`Toolset` of ``section``'s ``tools`` (``module:function`` or a built-in's name) and ``environment``
    (``module:Class``, a built-in's name, or a mapping of names to them), found in a tool process: the modules are
    imported and each environment constructed (no arguments, as TRL's factory) there, under ``limits`` (each item
    within ``timeout_s``). Raises :class:`ToolsetError` with every problem, keyed ``{section}.tools[i]``,
    ``{section}.environment`` or ``{section}.environment.NAME``."""
    environments = {} if environment is None else (
        {None: environment} if isinstance(environment, str) else dict(environment))
    worker = _Worker(limits, section, None)
    try:
        worker.reply()  # started
        worker.send(("describe", list(tools), environments), limits.timeout_s)
        reply = worker.reply()
    except _Ended as ended:
        if worker.at is None:
            key = f"{section}.tools" if tools else f"{section}.environment"
            message = f"the process that describes the tools {_start_failure(ended)}"
        else:
            key = worker.at
            message = _ended_text("importing or constructing it", ended.failure, ended.detail, limits, section)
        raise ToolsetError([(key, message)]) from None
    finally:
        worker.stop()
    if reply[0] == "problems":
        raise ToolsetError(reply[1])
    return reply[1]


@dataclass
class _Step:
    """One request a rollout's process answers: ``kind`` "start", "reset", "call", "async" or "reward"; ``slots``,
    for calls, their positions in :meth:`ToolWorkers.call`'s answer; ``replay``, for a step replayed on a new
    process, the reply it gave the first time."""

    kind: str
    request: tuple = ()
    slots: list[int] = field(default_factory=list)
    replay: tuple | None = None


class ToolWorkers:
    """One rank's tool processes, one per rollout of a round (:meth:`open`), kept across rounds. Not thread-safe: one
    thread, the trainer's main thread, uses it (the kernel ends the processes when the thread that started them
    ends). ``stats`` counts, since it was made: ``calls`` answered, ``failures`` among them, ``timeouts`` (processes
    killed at ``timeout_s``), ``crashes`` (processes that died on their own: a signal, an exit, the CPU limit),
    ``replaced`` (processes started in place of dead ones) and ``lost`` (environments whose replay failed)."""

    def __init__(self, toolset: Toolset, limits: Limits, section: str, rank: int):
        self.toolset, self.limits, self.section, self.rank = toolset, limits, section, rank
        self.stats = dict.fromkeys(("calls", "failures", "timeouts", "crashes", "replaced", "lost"), 0)
        self._workers: list[_Worker | None] = []
        self._rollouts: list[tuple[str | None, dict]] = []
        self._history: list[list[_Step]] = []  # per rollout, the steps of this round to replay on a new process
        self._lost: dict[int, str] = {}  # rollout -> the error of its calls
        self._started: set[int] = set()  # rollouts that had a process: a new one replaces it
        self._answers: list = []  # the current open/call/rewards answer, filled by the steps
        self._errors: dict[int, str] = {}  # rollout -> RolloutError message, for the current open/call/rewards
        self._stop = weakref.finalize(self, _stop_all, self._workers)

    def open(self, rollouts: list[tuple[str | None, dict]]) -> list[str | None]:
        """Start a round: one (environment name or None, the row's columns) per rollout of this rank. With
        environments, each rollout's process calls ``reset(**row)`` on its instance of the environment (made once per
        process and name) and its observation is returned (None, or the observation as ``str``); without, the
        processes are started and [None] * n returned. A reset that raises, hangs or crashes is a
        :class:`RolloutError` naming the environment, the rollout and what happened."""
        for i, (environment, _) in enumerate(rollouts):
            if environment not in (self.toolset.environments or {None: None}):
                raise ValueError(f"rollout {i} names environment {environment!r}, not one of the toolset's: "
                                 f"{list(self.toolset.environments)}")
        self._rollouts = list(rollouts)
        self._history = [[] for _ in rollouts]
        self._lost = {}
        self._answers = [None] * len(rollouts)
        queues = {i: deque([_Step("reset", ("reset", environment, row)) if self.toolset.environments else _Step("start")])
                  for i, (environment, row) in enumerate(rollouts)}
        self._drive(queues)
        return list(self._answers)

    def call(self, calls: list[tuple[int, str, Any]]) -> list[tuple[str, str | None]]:
        """One turn's tool calls, (rollout, tool name, arguments as parsed: normally a dict, called ``fn(**arguments)``
        as TRL calls it): the rollouts' at the same time, a rollout's sync calls one after another in the given order,
        then its async calls together (as TRL). Returns, per call in the given order, (content, failure): content is
        the tool message's text, ``str(result)`` (a list, TRL's multimodal result, is ``str()``-ed too: not
        supported) or ``str({"error": message})``; failure is None or one of :data:`FAILURES` (TRL's messages where
        TRL has them: ``{"error": str(exception)}``, ``Tool NAME not found.``). A process that dies on a call is
        replaced; with an environment, the new one replays the rollout's reset and its earlier calls of the round
        (each must give the same result again) before the next call, else the environment is ``lost``: its further
        calls fail and its reward is None."""
        self._answers = [None] * len(calls)
        queues: dict[int, deque] = {}
        coroutines: dict[int, list[tuple[int, str, Any]]] = {}
        for slot, (i, name, arguments) in enumerate(calls):
            if not 0 <= i < len(self._rollouts):
                raise ValueError(f"rollout {i} is not open: this round has {len(self._rollouts)}")
            environment = self._rollouts[i][0]
            if i in self._lost:
                self._answers[slot] = (_error(self._lost[i]), "lost")
            elif name not in self.toolset.names(environment):
                self._answers[slot] = (_error(f"Tool {name} not found."), "unknown_tool")
            elif name in self.toolset.asynchronous[environment]:
                coroutines.setdefault(i, []).append((slot, name, arguments))
            else:
                queues.setdefault(i, deque()).append(_Step("call", ("call", name, arguments), [slot]))
        for i, group in coroutines.items():
            queues.setdefault(i, deque()).append(
                _Step("async", ("async", [(name, arguments) for _, name, arguments in group]), [s for s, _, _ in group]))
        self._drive(queues)
        self.stats["calls"] += len(calls)
        self.stats["failures"] += sum(failure is not None for _, failure in self._answers)
        return list(self._answers)

    def rewards(self) -> list[float | None]:
        """Per open rollout, after its last turn: its environment's ``get_reward()`` (awaited when it is a coroutine
        function) when its class defines it, else None (None too for a lost environment). One that raises, hangs,
        crashes or returns no finite number is a :class:`RolloutError`."""
        self._answers = [None] * len(self._rollouts)
        queues = {i: deque([_Step("reward", ("reward",))]) for i, (environment, _) in enumerate(self._rollouts)
                  if self.toolset.rewarded.get(environment) and i not in self._lost}
        self._drive(queues)
        return list(self._answers)

    def close(self) -> None:
        """Kill every tool process and what it started (its process group), and reap them; also at exit."""
        self._stop()

    def __enter__(self) -> ToolWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drive(self, queues: dict[int, deque]) -> None:
        """Run each rollout's steps in order, the rollouts' at the same time, starting processes where one is missing;
        then raise the :class:`RolloutError` of the first rollout that had one."""
        self._errors = {}
        busy: dict[int, _Step] = {}
        while True:
            for i, queue in list(queues.items()):
                if i in busy:
                    continue
                if not queue:
                    del queues[i]
                    continue
                while len(self._workers) <= i:
                    self._workers.append(None)
                if self._workers[i] is None:
                    busy[i] = self._start(i)
                    continue
                step = queue.popleft()
                if step.kind != "start" and self._workers[i].proc.poll() is not None:
                    # Its process ended after its last reply (a thread of a tool's that exits, the OOM killer): a
                    # new one, with the rollout's state replayed, takes the step; none of its calls failed.
                    self._workers[i].stop()
                    self._workers[i] = None
                    self.stats["crashes"] += 1
                    pending = [queued for queued in (step, *queue) if queued.replay is None]
                    queue.clear()
                    queue.extend(pending)
                    if self._rollouts[i][0] in self.toolset.environments:
                        queue.extendleft(reversed(self._history[i]))
                    busy[i] = self._start(i)
                    continue
                if step.kind != "start":  # (one that runs already)
                    timeout = self.limits.timeout_s + (ASYNC_GRACE_S if step.kind == "async" else 0)
                    busy[i] = step
                    try:
                        self._workers[i].send(step.request, timeout)
                    except OSError:  # its process ended while idle: the wait below reads its end's EOF
                        pass
            if not busy:
                break
            soonest = min(self._workers[i].deadline for i in busy)
            ready = wait([w for i in busy for w in self._workers[i].waitables()], max(soonest - time.monotonic(), 0))
            for i in list(busy):
                worker = self._workers[i]
                try:
                    if worker.conn in ready or worker.pidfd in ready:
                        reply = worker.receive()
                    elif time.monotonic() >= worker.deadline:
                        worker.stop()
                        raise _Ended("timeout", "")
                    else:
                        continue
                except _Ended as ended:
                    self._workers[i] = None
                    self.stats["timeouts" if ended.failure == "timeout" else "crashes"] += 1
                    self._ended(i, busy.pop(i), ended, queues)
                    continue
                if reply is not None:  # None: progress
                    self._answered(i, busy.pop(i), reply, queues)
        if self._errors:
            raise RolloutError(self._errors[min(self._errors)])

    def _start(self, i: int) -> _Step:
        """Start rollout ``i``'s process; its first reply answers the returned step."""
        if i in self._started:
            self.stats["replaced"] += 1
        self._started.add(i)
        self._workers[i] = _Worker(self.limits, self.section, self.toolset)
        return _Step("start")

    def _answered(self, i: int, step: _Step, reply: tuple, queues: dict[int, deque]) -> None:
        """A step's reply: the answer it holds, kept for replay; a replay that gives another reply loses the
        environment."""
        if step.replay is not None:
            if reply != step.replay:
                self._lose(i, "its replayed calls gave other results than the first time", queues)
            return
        status, value = reply
        if status == "error":
            if step.kind == "start":
                self._workers[i].stop()
                self._workers[i] = None
                queues.pop(i, None)
            subject = {"start": "its tool process", "reset": f"{self._environment(i)}.reset",
                       "reward": f"{self._environment(i)}.get_reward"}[step.kind]
            self._errors[i] = f"{self._key(i)}: rollout {i} on rank {self.rank}: {subject} {value}"
            return
        if step.kind in ("reset", "reward"):
            self._answers[i] = value
        elif step.kind == "call":
            self._answers[step.slots[0]] = value
        elif step.kind == "async":
            for slot, answer in zip(step.slots, value):
                self._answers[slot] = answer
        if step.kind in ("reset", "call", "async"):
            self._history[i].append(_Step(step.kind, step.request, replay=reply))

    def _ended(self, i: int, step: _Step, ended: _Ended, queues: dict[int, deque]) -> None:
        """A step whose process died or was killed: a start, reset or reward is a :class:`RolloutError`; calls are
        the error of how it ended, then the rollout's history is queued for replay on a new process; a replayed
        step loses the environment."""
        if step.kind == "start":
            self._errors[i] = f"{self._key(i)}: rollout {i} on rank {self.rank}: its tool process {_start_failure(ended)}"
            queues.pop(i, None)
            return
        if step.replay is not None:
            self._lose(i, _ended_text("a replayed call", ended.failure, ended.detail, self.limits, self.section),
                       queues)
            return
        if step.kind in ("reset", "reward"):
            method = f"{self._environment(i)}.{'reset' if step.kind == 'reset' else 'get_reward'}"
            what = _ended_text(method, ended.failure, ended.detail, self.limits, self.section)
            self._errors[i] = f"{self._key(i)}: rollout {i} on rank {self.rank}: {what}"
            return
        text = _error(_ended_text("the call", ended.failure, ended.detail, self.limits, self.section))
        for slot in step.slots:
            self._answers[slot] = (text, ended.failure)
        if self._rollouts[i][0] in self.toolset.environments and self._history[i]:
            queues.setdefault(i, deque()).extendleft(reversed(self._history[i]))

    def _lose(self, i: int, why: str, queues: dict[int, deque]) -> None:
        """The environment of rollout ``i`` cannot be brought back: its pending calls, and all later ones, fail."""
        self._lost[i] = (f"the environment was lost: its process ended on an earlier call, and {why}; its calls fail "
                         "until the next round")
        self.stats["lost"] += 1
        for step in queues.pop(i, deque()):
            for slot in step.slots if step.replay is None else ():
                self._answers[slot] = (_error(self._lost[i]), "lost")

    def _environment(self, i: int) -> str:
        return self.toolset.environments.get(self._rollouts[i][0], "its tools")

    def _key(self, i: int) -> str:
        environment = self._rollouts[i][0]
        return f"{self.section}.environment" + ("" if environment is None else f".{environment}")


def _error(message: str) -> str:
    """A failed call's tool message text, as TRL writes it: ``str({"error": message})``."""
    return str({"error": message})


def _ended_text(subject: str, failure: str, detail: str, limits: Limits, section: str) -> str:
    """What ended ``subject``'s process, deterministic (no process id, no time measured)."""
    if failure == "timeout":
        return (f"{subject} did not return within {limits.timeout_s:g} s ({section}.tool_timeout_s); its process was "
                "stopped")
    if failure == "cpu":
        return f"{subject} used over {limits.cpu_s:g} s of CPU time ({section}.tool_cpu_s); its process was stopped"
    return f"{subject} crashed: its process ended ({detail})"


def _start_failure(ended: _Ended) -> str:
    if ended.failure == "timeout":
        return f"did not start within {START_TIMEOUT_S:g} s"
    return f"ended as it started ({ended.detail})"


def _stop_all(workers: list[_Worker | None]) -> None:
    for worker in workers:
        if worker is not None:
            worker.stop()


class _Ended(Exception):
    """A tool process that ended or was killed: ``failure`` "timeout", "cpu" or "crashed", ``detail`` its exit code
    or signal."""

    def __init__(self, failure: str, detail: str):
        super().__init__(failure, detail)
        self.failure, self.detail = failure, detail


class _Worker:
    """One tool process (:func:`_serve`), in a process group of its own, and its connection. ``deadline``: when the
    request in flight must be answered; ``at``: the item it last said it works on (:func:`describe`)."""

    def __init__(self, limits: Limits, section: str, toolset: Toolset | None):
        ours, theirs = socket.socketpair()
        lifeline, self._lifeline = os.pipe()
        code = f"import sys; sys.path.insert(0, {_ROOT!r}); from hfsdp.builtin.agent.runtime import _serve; _serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(lifeline), str(os.getpid())],
            pass_fds=(theirs.fileno(), lifeline), stdin=subprocess.DEVNULL, start_new_session=True,
            env={**dict.fromkeys(_THREADS, "1"), **os.environ})
        theirs.close()
        os.close(lifeline)
        self.conn = Connection(ours.detach())
        # The process's own end, watched beside the connection: a child it forked holds the connection's other end
        # too (a fork copies every descriptor), so that the connection alone would not tell its death until the
        # deadline (a crash then read as a timeout).
        try:
            self.pidfd: int | None = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # Linux before 5.3
            self.pidfd = None
        self.at: str | None = None
        self.timeout_s = 0.0
        self.deadline = 0.0
        self.send(("hello", sys.path, limits, section, toolset), START_TIMEOUT_S)

    def send(self, request: tuple, timeout_s: float) -> None:
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.conn.send(request)

    def waitables(self) -> list:
        """What :func:`multiprocessing.connection.wait` watches for this process: its connection, its pidfd."""
        return [self.conn] if self.pidfd is None else [self.conn, self.pidfd]

    def receive(self) -> tuple | None:
        """The reply (the caller waited for the connection or the process's end), or None for progress
        (``("at", item)``, which gives the item ``timeout_s`` of its own); :class:`_Ended` if the process closed its
        end or ended with nothing left to read."""
        try:
            if not self.conn.poll(0):  # woken by the process's end, not by its connection
                raise EOFError
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise self._ended() from None
        if reply[0] == "at":
            self.at, self.deadline = reply[1], time.monotonic() + self.timeout_s
            return None
        return reply

    def reply(self) -> tuple:
        """The reply to the request in flight, waited for until the deadline; :class:`_Ended` on a death or the
        deadline (the process is then killed)."""
        while True:
            if not wait(self.waitables(), max(self.deadline - time.monotonic(), 0)):
                self.stop()
                raise _Ended("timeout", "")
            reply = self.receive()
            if reply is not None:
                return reply

    def _ended(self) -> _Ended:
        """How the process that closed its end ended: its exit code or signal (SIGXCPU: the CPU limit)."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.stop()
            return _Ended("crashed", "it closed its connection")
        self.stop()
        if code == -signal.SIGXCPU:
            return _Ended("cpu", "signal SIGXCPU")
        return _Ended("crashed", f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")

    def stop(self) -> None:
        """Kill the process group (the process and what it started: what outlives the process too) and reap the
        process; idempotent."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:  # no such group left
            pass
        self.proc.wait()
        if not self.conn.closed:
            self.conn.close()
            os.close(self._lifeline)
            if self.pidfd is not None:
                os.close(self.pidfd)


# The tool process's side.


def _serve() -> None:
    """A tool process's life: tied to its parent, limited, then the requests of :class:`_Worker` until its parent
    closes the connection. argv: the connection's descriptor, the lifeline's, the parent's process id."""
    connection, lifeline, parent = (int(arg) for arg in sys.argv[1:4])
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the parent's thread ends
    if os.getppid() != parent:
        os._exit(1)
    if os.fork() == 0:  # before any thread: the lifeline's watcher, a process of this group
        _lifeline(lifeline)
    os.close(lifeline)
    conn = Connection(connection)
    _, path, limits, section, toolset = conn.recv()
    sys.path[:] = path
    _limit(limits.memory_mb)
    served = _Served(conn, limits, section)
    conn.send(served.load(toolset))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(usage.ru_utime + usage.ru_stime + limits.cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        conn.send(served.handle(request))


def _lifeline(fd: int) -> None:
    """The watcher: kill the tool process's group when the parent's end of the lifeline closes (the parent died or
    closed it); never returns. A process of its own, not a thread of the tool process: PR_SET_PDEATHSIG kills the
    tool process at once, with no chance to kill its group (what a tool started outlived the trainer), and a thread
    would need the GIL a tool may hold. It keeps no descriptor but the lifeline (the connection's end would hide a
    crash of the tool process) and no parent-death signal (a fork clears it)."""
    try:
        os.closerange(3, fd)
        os.closerange(fd + 1, 1 << 20)
        while os.read(fd, 1):
            pass
    finally:
        os.killpg(0, signal.SIGKILL)


def _limit(memory_mb: int) -> None:
    """The tool process's own limits, before any user module is imported: its address space, no core files, and the
    kernel's out-of-memory killer takes it (and what it starts) before the trainer."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    size = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (size, size) if hard == resource.RLIM_INFINITY else (min(size, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("1000")


class _Problem(Exception):
    """A tool or environment that cannot be used, and how to fix it."""


def _resolve(name: str, builtins: dict[str, str], what: str) -> tuple[str, Any]:
    """(``module:attr``, the object) of a tool (``what`` "function") or environment (``what`` "Class") name."""
    if ":" not in name:
        if name not in builtins:
            raise _Problem(f"'{name}' is not one of hfsdp's ({', '.join(sorted(builtins))}); name one of them, or "
                           f"your own as module:{what}")
        name = builtins[name]
    module, _, attr = name.partition(":")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        raise _Problem(f"'{name}': cannot import module '{module}' ({err}); check the name and that it is installed "
                       "or on PYTHONPATH") from None
    except Exception as err:  # noqa: BLE001 (the module's own error, reported with its fix)
        raise _Problem(f"'{name}': importing module '{module}' raised {_raised(err)}; fix the module") from None
    if not hasattr(found, attr):
        raise _Problem(f"'{name}': module '{module}' has no attribute '{attr}'; name a {what} it defines")
    found = getattr(found, attr)
    if not callable(found):
        raise _Problem(f"'{name}' is not callable (its type: {type(found).__name__}); name a {what}")
    return name, found


def _raised(err: BaseException) -> str:
    """An exception as one line: its type, message and the innermost line it came from, outside this module (an
    environment's __init__ called with no arguments raises at the call, here: no line of hfsdp's is named)."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    where = [frame for frame in frames if frame.filename != __file__][-1:]
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    return f"{type(err).__name__}: {err}{at}"


def _methods(instance: Any) -> list[str]:
    """The tool methods of an environment instance, as TRL lists them: its class's functions by name, ``reset``,
    ``get_reward`` and private names left out."""
    return [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def _has(instance: Any, method: str) -> bool:
    return any(name == method for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction))


class _Served:
    """What a tool process holds: the standalone tools by name, the environments' factories and instances (one per
    name, made at its first reset), the current round's environment and tools."""

    def __init__(self, conn: Connection, limits: Limits, section: str):
        self.conn, self.limits, self.section = conn, limits, section
        self.tools: dict[str, Callable] = {}
        self.factories: dict[str | None, Callable] = {}
        self.instances: dict[str | None, Any] = {}
        self.current: Any = None
        self.table: dict[str, Callable] = {}
        self.get_json_schema: Callable | None = None

    def load(self, toolset: Toolset | None) -> tuple:
        """Import the toolset's tools and environments, or (None: a process for :func:`describe`) transformers'
        schema writer."""
        if toolset is None:
            from transformers.utils import chat_template_utils

            # Its type table imports torch where torch is installed (for a torch.Tensor hint, "audio"): over a second
            # and about 1 GB of address space, past a small tool_memory_mb, where every tool was then refused with
            # "libtorch_cpu.so: failed to map segment". No tool of a rollout takes a tensor: not here, torch stays out.
            chat_template_utils.is_torch_available = lambda: False
            self.get_json_schema = chat_template_utils.get_json_schema
        else:
            try:
                self.tools = {fn.__name__: fn for fn in (_resolve(spec, {}, "function")[1] for spec in toolset.tools)}
                self.factories = {name: _resolve(spec, {}, "Class")[1]
                                  for name, spec in toolset.environments.items()}
            except _Problem as problem:
                return ("error", f"could not import its tools: {problem}")
            self.table = dict(self.tools)
        return ("ok", None)

    def handle(self, request: tuple) -> tuple:
        kind, *args = request
        return {"reset": self.reset, "call": self.call, "async": self.call_async, "reward": self.reward,
                "describe": self.describe}[kind](*args)

    def reset(self, environment: str | None, row: dict) -> tuple:
        try:
            if environment not in self.instances:
                self.instances[environment] = self.factories[environment]()
            instance = self.instances[environment]
            observation = instance.reset(**row)
        except Exception as err:  # noqa: BLE001 (the environment's error, the run's end)
            return ("error", f"raised {_raised(err)}")
        self.current = instance
        self.table = {**self.tools, **{name: getattr(instance, name) for name in _methods(instance)}}
        return ("ok", None if observation is None else str(observation))

    def call(self, name: str, arguments: Any) -> tuple:
        return ("ok", self._result(lambda: self.table[name](**arguments)))

    def call_async(self, calls: list[tuple[str, Any]]) -> tuple:
        """A rollout's async calls together, each cancelled at ``timeout_s``; their answers in the given order."""
        async def one(name: str, arguments: Any) -> tuple[str, str | None]:
            try:
                task = asyncio.ensure_future(self.table[name](**arguments))
            except Exception as err:  # noqa: BLE001 (TRL: the call's error)
                return (_error(str(err)), "raised")
            done, _ = await asyncio.wait({task}, timeout=self.limits.timeout_s)
            if not done:
                task.cancel()
                return (_error(f"the call did not return within {self.limits.timeout_s:g} s "
                               f"({self.section}.tool_timeout_s); it was cancelled"), "timeout")
            return self._result(task.result)

        async def every() -> list:
            return list(await asyncio.gather(*(one(name, arguments) for name, arguments in calls)))

        return ("ok", asyncio.run(every()))

    def _result(self, produce: Callable[[], Any]) -> tuple[str, str | None]:
        """(content, failure) of one call: ``str(result)``, or TRL's error text."""
        try:
            text = str(produce())
        except MemoryError:
            return (_error(f"the call ran out of memory: a tool process may use {self.limits.memory_mb} MB "
                           f"({self.section}.tool_memory_mb)"), "memory")
        except Exception as err:  # noqa: BLE001 (TRL: the call's error)
            return (_error(str(err)), "raised")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > RESULT_LIMIT:
            return (_error(f"the result is {size} bytes long, over the limit of {RESULT_LIMIT} bytes (1 MiB); "
                           "return less"), "too_long")
        return (text, None)

    def reward(self) -> tuple:
        try:
            value = self.current.get_reward()
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except Exception as err:  # noqa: BLE001 (the environment's error, the run's end)
            return ("error", f"raised {_raised(err)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return ("error", f"returned {type(value).__name__} {str(value)[:80]!r}, not a finite number")
        return ("ok", float(value))

    def describe(self, tools: list[str], environments: dict[str | None, str]) -> tuple:
        """(``"ok"``, :class:`Toolset`) or (``"problems"``, every problem), telling the parent each item it starts
        (``("at", key)``: the item a hang or crash is reported at)."""
        problems: list[tuple[str, str]] = []
        specs, schemas, coroutines, keys = [], [], set(), {}
        for k, name in enumerate(tools):
            key = f"{self.section}.tools[{k}]"
            self.conn.send(("at", key))
            try:
                spec, fn = _resolve(name, BUILTIN_TOOLS, "function")
                schema = _schema(spec, fn, self.get_json_schema)
            except _Problem as problem:
                problems.append((key, str(problem)))
                continue
            if fn.__name__ in keys:
                problems.append((key, f"'{name}' is named {fn.__name__}, as {keys[fn.__name__]} is: the model calls "
                                      "tools by name; rename one"))
                continue
            keys[fn.__name__] = key
            specs.append(spec)
            schemas.append(schema)
            if inspect.iscoroutinefunction(fn):
                coroutines.add(fn.__name__)
        if not environments:
            toolset = Toolset(tuple(specs), {}, {None: schemas}, {None: frozenset(coroutines)}, {None: None})
            return ("problems", problems) if problems else ("ok", toolset)
        toolset = Toolset(tuple(specs), {}, {}, {}, {})
        for environment, name in environments.items():
            key = f"{self.section}.environment" + ("" if environment is None else f".{environment}")
            self.conn.send(("at", key))
            try:
                spec, own, rewarded = self._environment(name, keys)
            except _Problem as problem:
                problems.append((key, str(problem)))
                continue
            toolset.environments[environment] = spec
            toolset.schemas[environment] = schemas + [schema for schema, _ in own]
            toolset.asynchronous[environment] = frozenset(coroutines | {schema["function"]["name"]
                                                                         for schema, coroutine in own if coroutine})
            toolset.rewarded[environment] = rewarded
        return ("problems", problems) if problems else ("ok", toolset)

    def _environment(self, name: str, keys: dict[str, str]) -> tuple[str, list[tuple[dict, bool]], str | None]:
        """(``module:Class``, (schema, whether a coroutine) of each tool method, its class's name if it defines
        get_reward) of one environment, made with no arguments as TRL's factory makes it."""
        spec, factory = _resolve(name, BUILTIN_ENVIRONMENTS, "Class")
        try:
            instance = factory()
        except Exception as err:  # noqa: BLE001 (the environment's error, reported with its fix)
            raise _Problem(f"'{spec}()' raised {_raised(err)}; an environment is made with no arguments (TRL's "
                           "environment_factory): give its __init__ arguments defaults") from None
        cls = type(instance).__name__
        if not _has(instance, "reset"):
            raise _Problem(f"'{spec}' ({cls}) has no reset method: define reset(self, **row), which TRL calls with "
                           "the row's columns before each rollout (it may return an observation: text appended to "
                           "the prompt)")
        own = []
        for method in _methods(instance):
            if method in keys:
                raise _Problem(f"'{spec}' has a method {method}, a name {keys[method]} gives a tool too: the model "
                               "calls tools by name; rename one")
            bound = getattr(instance, method)
            own.append((_schema(f"{cls}.{method}", bound, self.get_json_schema), inspect.iscoroutinefunction(bound)))
        return spec, own, cls if _has(instance, "get_reward") else None


def _schema(label: str, fn: Callable, get_json_schema: Callable) -> dict:
    """The JSON schema TRL renders for ``fn``, or a :class:`_Problem` that names what its definition lacks."""
    try:
        return get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 (transformers' TypeHintParsingException, DocstringParsingException)
        raise _Problem(f"'{label}': {err}. The tool's JSON schema is written from its type hints and docstring: give "
                       "every argument a type hint, and the docstring a description and an Args: line for each "
                       "argument") from None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
