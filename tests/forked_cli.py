"""The real CLI, each call in a process of its own forked from one that imported hfsdp's heavy dependencies once.

``python tests/forked_cli.py`` (started with the environment the calls share) imports torch, transformers,
accelerate, datasets and peft, then reads one JSON request a line on stdin: ``{"argv": [...], "cwd": ...,
"env": {...}, "stdout": path, "stderr": path}``. For each it forks: the child changes to ``cwd``, takes ``env`` as
its whole environment, writes its stdout and stderr to the two files and runs ``hfsdp.cli.main()`` with ``argv``
and the working directory first on ``sys.path``, as ``python -m hfsdp ARGV`` would; the parent answers
``{"returncode": N}`` on stdout once the child has exited.
What differs from a fresh ``python -m hfsdp``: only the imports are already done (about 6 s a call saved on 2 cores),
so a call whose environment changes what Python or a library reads at start-up (``PYTHONPATH``, a library's
import-time settings) must run as a fresh process instead (:class:`ForkedCli` users decide which).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def serve() -> None:
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import hfsdp.cli

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the requests' pipe
                for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                sys.path[0] = os.getcwd()  # as python -m puts it first (here: this file's folder)
                sys.argv = ["hfsdp", *request["argv"]]
                try:
                    hfsdp.cli.main()
                    code = 0
                except SystemExit as done:  # as the interpreter ends: a message is printed, exit 1
                    code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
                    if not isinstance(done.code, int) and done.code is not None:
                        print(done.code, file=sys.stderr)
                except BaseException:  # what python -m hfsdp would print: the traceback, exit 1
                    import traceback

                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkedCli:
    """A :func:`serve` process; :meth:`run` is ``subprocess.run([python, -m, hfsdp, *argv], cwd, env)`` through it
    (one call at a time: give each thread its own)."""

    def __init__(self, env: dict[str, str], scratch: Path):
        self.scratch = scratch  # where each call's stdout and stderr are written (not its cwd: the case's own)
        self.proc = subprocess.Popen([sys.executable, __file__], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
        import select

        out, err = (self._scratch_file(suffix) for suffix in (".out", ".err"))
        argv = [str(a) for a in argv]  # paths too, as subprocess takes them
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out),
                                          "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.proc.kill()
            raise subprocess.TimeoutExpired(argv, timeout)
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/forked_cli.py exited {self.proc.wait()} before answering")
        done = subprocess.CompletedProcess([sys.executable, "-m", "hfsdp", *argv], json.loads(answer)["returncode"],
                                           out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def _scratch_file(self, suffix: str) -> Path:
        import tempfile

        fd, path = tempfile.mkstemp(dir=self.scratch, suffix=suffix)
        os.close(fd)  # the child opens it by name
        return Path(path)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    serve()
