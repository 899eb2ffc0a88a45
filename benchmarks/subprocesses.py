"""The one way benchmark scripts start what they measure (``hfsdp train``, torchrun, TRL, a bare loop):
:func:`run`, ``subprocess.run``'s signature, with the child in a session of its own and SIGTERM / SIGINT passed on to
it. A benchmark stopped by a scheduler's SIGTERM or a Ctrl-C then stops its training run the way hfsdp documents (a
checkpoint at the end of the step, exit 143 or 130) instead of leaving it running, orphaned, on the machine; the
script waits for it and exits with the same code. A second signal is passed on too (hfsdp then exits at once)."""

from __future__ import annotations

import signal
import subprocess
import sys

_running: set[subprocess.Popen] = set()
_stopping: list[int] = []


def _pass_on(signum, frame) -> None:
    _stopping.append(signum)
    for proc in list(_running):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _install() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not _pass_on:
            signal.signal(signum, _pass_on)


def run(cmd, *, check: bool = False, timeout: float | None = None, input=None, capture_output: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` with the child started in a new session (a Ctrl-C in the terminal reaches this
    script only, which passes it on once) and SIGTERM / SIGINT passed on to it while it runs; once it has ended
    after such a signal, this process exits 128 + the signal's number."""
    _install()
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.PIPE if input is not None else None,
                          **kwargs) as proc:
        _running.add(proc)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            _running.discard(proc)
    if _stopping:
        print(f"{sys.argv[0]}: stopped by signal {_stopping[0]}; {cmd[0]} ... exited {proc.returncode}",
              file=sys.stderr)
        sys.exit(128 + _stopping[0])
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
