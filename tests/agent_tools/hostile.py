"""Tools and environments that misbehave in their tool process (tests/test_agent_runtime.py runs them through
:mod:`hfsdp.builtin.agent.runtime`): they raise, hang, spin, allocate 50 GB, segfault, exit, kill themselves, return
2 MiB, leave a child behind; environments whose reset or reward fails, one whose state a crash must not lose (it is
replayed) and one whose replay gives other results (lost). Every tool has the type hints and docstring (``Args:``)
that transformers' ``get_json_schema`` needs, except the few made to be refused by ``describe``.

Counts that must outlive a tool process (which invocation crashes, what a replay sees) are kept in files under the
folder ``$HOSTILE_DIR`` (set by the test; the tool processes inherit the trainer's environment)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _bump(name: str) -> int:
    """How many times ``name`` was counted, this one included, across processes (a file under $HOSTILE_DIR)."""
    path = Path(os.environ["HOSTILE_DIR"]) / name
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    return count


def echo(text: str) -> str:
    """Return the text it is given.

    Args:
        text: what to return
    """
    return f"echo: {text}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def raises(value: int) -> str:
    """Raise a ValueError naming the value.

    Args:
        value: the value named in the error
    """
    raise ValueError(f"bad value {value}")


def hangs() -> str:
    """Sleep forever."""
    time.sleep(10**6)
    return "woke up"


def spins() -> str:
    """Burn CPU forever."""
    while True:
        pass


def hogs() -> str:
    """Allocate 50 GB at once."""
    return str(len(bytearray(50 << 30)))


def hogs_slowly() -> str:
    """Allocate 64 MiB after 64 MiB until 50 GB, each touched."""
    chunks = []
    for _ in range(800):
        chunks.append(b"x" * (64 << 20))
    return str(len(chunks))


def segfaults() -> str:
    """Read the memory at address 0."""
    return str(ctypes.string_at(0))


def exits() -> str:
    """End its process with exit code 3, at once."""
    os._exit(3)


def kills_itself() -> str:
    """Send its own process SIGKILL."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)
    return "still alive"


def floods() -> str:
    """Return 2 MiB of text."""
    return "x" * (2 << 20)


def spawns(path: str) -> str:
    """Start a child process that sleeps for an hour (in this process's group), write its process id to a file.

    Args:
        path: the file that gets the child's process id
    """
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(path).write_text(str(child.pid))
    return "started"


def forks_then_exits(path: str) -> str:
    """Fork a child that sleeps for an hour (holding every descriptor of this process), write its process id to a
    file, then end this process with exit code 5.

    Args:
        path: the file that gets the child's process id
    """
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    Path(path).write_text(str(pid))
    os._exit(5)


async def async_echo(text: str) -> str:
    """Return the text it is given, after yielding once to the event loop.

    Args:
        text: what to return
    """
    await asyncio.sleep(0.01)
    return f"async echo: {text}"


async def async_hangs() -> str:
    """Await forever."""
    await asyncio.sleep(10**6)
    return "woke up"


async def async_blocks() -> str:
    """Block the event loop forever (a synchronous sleep in a coroutine)."""
    time.sleep(10**6)
    return "woke up"


async def async_raises(value: int) -> str:
    """Raise a ValueError naming the value.

    Args:
        value: the value named in the error
    """
    await asyncio.sleep(0)
    raise ValueError(f"async bad value {value}")


class Counter:
    """A total that each rollout starts at its row's ``start`` and its calls add to; its reward is the total."""

    def reset(self, start: int = 0, **row) -> str:
        self.total = start
        return f"total {self.total}"

    def increment(self, n: int) -> str:
        """Add to the total and return it.

        Args:
            n: what to add
        """
        self.total += n
        return f"total {self.total}"

    def crashy_increment(self, n: int) -> str:
        """Add to the total and return it; its 2nd invocation across every process ends its process (exit code 7).

        Args:
            n: what to add
        """
        if _bump("crashy_increment") == 2:
            os._exit(7)
        self.total += n
        return f"total {self.total}"

    def crash(self) -> str:
        """End its process with a segfault."""
        return str(ctypes.string_at(0))

    def get_reward(self) -> float:
        return float(self.total)


class Drifting:
    """An environment whose results depend on how often its tool was called across processes: a replay differs."""

    def reset(self, **row) -> None:
        self.calls = 0

    def stamp(self) -> str:
        """Return how many times this tool has run, in every process."""
        return f"stamp {_bump('stamp')}"

    def crash(self) -> str:
        """End its process with exit code 9."""
        os._exit(9)

    def get_reward(self) -> float:
        return 1.0


class BrokenReset:
    """An environment whose reset raises."""

    def reset(self, **row) -> None:
        raise RuntimeError(f"no task for row {sorted(row)}")

    def noop(self) -> str:
        """Do nothing."""
        return "nothing"


class HangingReset:
    """An environment whose reset sleeps forever."""

    def reset(self, **row) -> None:
        time.sleep(10**6)

    def noop(self) -> str:
        """Do nothing."""
        return "nothing"


class NanReward:
    """An environment whose reward is NaN."""

    def reset(self, **row) -> None:
        pass

    def noop(self) -> str:
        """Do nothing."""
        return "nothing"

    def get_reward(self) -> float:
        return float("nan")


class RaisingReward:
    """An environment whose get_reward raises."""

    def reset(self, **row) -> None:
        pass

    def noop(self) -> str:
        """Do nothing."""
        return "nothing"

    def get_reward(self) -> float:
        raise ZeroDivisionError("no answer to score")


class AsyncEnv:
    """An environment with a sync and an async tool, and an async reward."""

    def reset(self, **row) -> str:
        self.log: list[str] = []
        return None

    def note(self, text: str) -> str:
        """Record a note.

        Args:
            text: the note
        """
        self.log.append(text)
        return f"noted {len(self.log)}"

    async def async_note(self, text: str) -> str:
        """Record a note, asynchronously.

        Args:
            text: the note
        """
        await asyncio.sleep(0.01)
        self.log.append(text)
        return f"async noted {len(self.log)}"

    async def get_reward(self) -> float:
        return float(len(self.log))


# What describe() refuses.


def untyped(x) -> str:
    """An argument without a type hint.

    Args:
        x: anything
    """
    return str(x)


def undocumented(x: int) -> str:
    """No Args section."""
    return str(x)


class NoReset:
    """An environment without reset."""

    def noop(self) -> str:
        """Do nothing."""
        return "nothing"


class NeedsArguments:
    """An environment whose __init__ needs an argument."""

    def __init__(self, path: str):
        self.path = path

    def reset(self, **row) -> None:
        pass


class ClashesWithEcho:
    """An environment with a method named as the standalone tool ``echo``."""

    def reset(self, **row) -> None:
        pass

    def echo(self, text: str) -> str:
        """Return the text it is given.

        Args:
            text: what to return
        """
        return text


NOT_CALLABLE = 42


def exits_after_returning() -> str:
    """Return, then end its process with exit code 4 a moment later (from a thread)."""
    threading.Timer(0.05, os._exit, (4,)).start()
    return "bye"


class HangingInit:
    """An environment whose construction sleeps forever."""

    def __init__(self):
        time.sleep(10**6)

    def reset(self, **row) -> None:
        pass
