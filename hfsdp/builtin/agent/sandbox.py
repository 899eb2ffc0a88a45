"""hfsdp's built-in tool ``python`` (:func:`python`) and environment ``python`` (:class:`PythonSandbox`): the model's
program run by bubblewrap (``bwrap``), never by the process that calls them.

What the program gets: the system's Python (:data:`INTERPRETER`) with its standard library and the system's own
packages (``/usr`` and the ``/lib`` folders, read-only), a folder of its own as its working directory, ``HOME`` and
``TMPDIR`` (the only place it can write: an empty 64 MB tmpfs for each call of :func:`python`, a folder kept between
the calls of one :class:`PythonSandbox` rollout), a ``/proc`` and ``/dev`` of its own, and an environment of a few
fixed variables (``PYTHONHASHSEED=0``: the same program prints the same output, set order included). What it does not
get: the network (a network namespace of its own: ``127.0.0.1`` is the sandbox's, with nothing listening), the host's
files (``/etc``, ``/root``, ``/home``, ``/work``, the run folder: not there at all), the trainer's environment
variables (bwrap itself starts with ``PATH`` only, so not even ``/proc/1/environ`` holds them), the host's processes
(a PID namespace), more user namespaces (``--disable-userns``), a terminal (``--new-session``), root (it runs as
``nobody``, and when the trainer is root bwrap itself is started as ``nobody``: the kernel does not count root's
processes against ``RLIMIT_NPROC``, which is what holds a fork bomb).

Its limits (per call, each process of the program): :data:`TIME_LIMIT_S` of wall clock for the whole call (then
every process of the sandbox is killed: they live in its PID namespace), :data:`CPU_LIMIT_S` of CPU time,
:data:`MEMORY_MB` of address space (the program gets a ``MemoryError``), :data:`PROCESSES` processes and threads,
files of :data:`FOLDER_MB` at most, no core dumps, and the kernel's out-of-memory killer takes its processes first
(``oom_score_adj`` 1000). The first :data:`OUTPUT_LIMIT` bytes of what it prints (stdout and stderr together, in
order: unbuffered) are returned, then a last line when it did not end cleanly (:func:`python` says which).

Not contained: the memory of the program's processes together (up to :data:`PROCESSES` x :data:`MEMORY_MB`; the
OOM killer's order protects the trainer) and, for :class:`PythonSandbox`, the total size of its folder on disk
(files of :data:`FOLDER_MB` each, for :data:`TIME_LIMIT_S` a call): without cgroups, which hfsdp does not assume,
neither has a kernel limit. :func:`sandbox_problem` says whether this host can sandbox at all; hfsdp refuses a
config that names ``python`` where it cannot, and :func:`python` raises rather than run a program unconfined."""

from __future__ import annotations

import functools
import glob
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import weakref

INTERPRETER = "/usr/bin/python3"
"""The sandbox's Python: the system's (Debian's ``python3``), not the trainer's, whose folders (a virtual environment
with torch, often under ``$HOME``) stay out of the sandbox."""
TIME_LIMIT_S = 6
"""Wall-clock seconds of one call, start-up included: below the tool call's own limit (``tool_timeout_s``), so that
the model reads this module's ``killed: over the 6 s time limit`` rather than the worker's timeout."""
CPU_LIMIT_S = 3
"""CPU seconds of each process of the program (``RLIMIT_CPU``: SIGXCPU, then SIGKILL a second later): half the
time limit, so that a busy loop is ended by it, with the same message every time, unless the host gives the program
under half a core."""
MEMORY_MB = 512
"""Address space of each process of the program (``RLIMIT_AS``), in MiB."""
PROCESSES = 16
"""Processes and threads of the program, bubblewrap's two included (``RLIMIT_NPROC``, counted in its own user
namespace)."""
FOLDER_MB = 64
"""Size of the tmpfs of a :func:`python` call and of each file the program writes (``RLIMIT_FSIZE``), in MiB."""
OUTPUT_LIMIT = 16 * 1024
"""Bytes of the program's output that are returned; the rest is read and dropped."""
SANDBOX_ID = 65534
"""The user and group the program runs as (``nobody``), inside the sandbox and, when the trainer is root, outside."""
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The program's whole environment."""
_FOLDER_PREFIX = "hfsdp-sandbox-"  # + the owning process's id + "-": folders of ended processes are swept


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: the Python program to run
    """
    return _run(code, None)


class PythonSandbox:
    """hfsdp's built-in environment ``python``: the tool ``python`` with a folder of the rollout's own, kept between
    its calls (a file one call writes, the next reads) and replaced by an empty one at each :meth:`reset`. The folder
    is removed at the next reset, when the instance goes, or when its process exits; one its process could not
    remove (killed) is removed by the next sandbox made on this host. Its tool is :meth:`python`; it has no reward."""

    def __init__(self) -> None:
        self._folder: str | None = None
        self._removal: weakref.finalize | None = None

    def reset(self, **row) -> None:
        """An empty folder for the rollout (the row's columns are not read); returns no observation."""
        if self._removal is not None:
            self._removal()
        self._folder = _new_folder()
        self._removal = weakref.finalize(self, _remove, self._folder)

    def python(self, code: str) -> str:
        """Run Python code in a sandbox whose folder keeps its files for the next call, and return what it printed.

        Args:
            code: the Python program to run
        """
        if self._folder is None:
            raise RuntimeError("PythonSandbox.python was called before reset, which makes its folder")
        return _run(code, self._folder)


@functools.cache
def sandbox_problem() -> str | None:
    """None when this host runs :func:`python`'s sandbox (a trial run that must print 42, once per process), else
    what is missing and how to fix it, in a few lines."""
    missing = [path for path in (INTERPRETER, "/usr/bin/prlimit", "/usr/bin/choom") if not os.access(path, os.X_OK)]
    if shutil.which("bwrap") is None or missing:
        what = ", ".join((["bwrap"] if shutil.which("bwrap") is None else []) + missing)
        return (f"the built-in python tool runs the model's code in a bubblewrap sandbox, and this host lacks {what}: "
                "install bubblewrap, util-linux and python3 (Debian/Ubuntu: apt-get install bubblewrap util-linux "
                "python3), or remove python from "
                "the tools and environment")
    try:
        output = _sandboxed("print(6 * 7)", None)
    except OSError as err:
        output = str(err)
    if output == "42\n":
        return None
    return (f"the built-in python tool runs the model's code in a bubblewrap sandbox, which does not work here:\n"
            f"  {output.strip()[-600:]}\n"
            "bwrap (0.8 or later) needs unprivileged user namespaces: sysctl user.max_user_namespaces above 0, "
            "kernel.unprivileged_userns_clone=1 (Debian 10 and older), kernel.apparmor_restrict_unprivileged_userns=0 "
            "(Ubuntu 23.10 and later); in a container, a seccomp profile that allows them (docker run "
            "--security-opt seccomp=unconfined). Or remove python from the tools and environment.")


def _run(code: str, folder: str | None) -> str:
    """:func:`_sandboxed` where the host can sandbox; a RuntimeError (the tool call's error) where it cannot."""
    problem = sandbox_problem()
    if problem is not None:
        raise RuntimeError(problem)
    return _sandboxed(code, folder)


def _sandboxed(code: str, folder: str | None) -> str:
    """Run ``code`` (read from stdin by the sandbox's Python) in the sandbox, with ``folder`` as its own folder (None:
    a new tmpfs), and report its output and how it ended."""
    with tempfile.TemporaryFile() as program:
        program.write(code.encode("utf-8", "replace"))
        program.seek(0)
        as_nobody = {"user": SANDBOX_ID, "group": SANDBOX_ID, "extra_groups": []} if os.geteuid() == 0 else {}
        proc = subprocess.Popen(_command(folder), stdin=program, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True, **as_nobody)
    try:
        output, cut, timed_out = _read(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap: its PID namespace, every process of the program, goes too
        proc.wait()
        proc.stdout.close()
    return _report(output, cut, _status(proc.returncode, timed_out))


def _command(folder: str | None) -> list[str]:
    """bwrap's command line: the namespaces, the read-only system folders, the program's folder, its environment,
    and the limits set (``prlimit``, ``choom``) inside, before the interpreter starts."""
    command = [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
               "--new-session", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--hostname", "sandbox",
               "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):  # a merged /usr: /lib -> usr/lib
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    command += ["--proc", "/proc", "--dev", "/dev"]
    if folder is None:
        command += ["--size", str(FOLDER_MB << 20), "--perms", "0700", "--tmpfs", "/sandbox"]
    else:
        command += ["--bind", folder, "/sandbox"]
    command += ["--chdir", "/sandbox", "--clearenv"]
    for name, value in ENVIRONMENT.items():
        command += ["--setenv", name, value]
    limits = [f"--as={MEMORY_MB << 20}", f"--cpu={CPU_LIMIT_S}:{CPU_LIMIT_S + 1}", f"--nproc={PROCESSES}",
              f"--fsize={FOLDER_MB << 20}", "--core=0"]
    return command + ["/usr/bin/choom", "-n", "1000", "--", "/usr/bin/prlimit", *limits, "--", INTERPRETER, "-s", "-"]


def _read(proc: subprocess.Popen) -> tuple[bytes, bool, bool]:
    """(the first :data:`OUTPUT_LIMIT` bytes of the output, whether there was more, whether the time limit struck)."""
    deadline = time.monotonic() + TIME_LIMIT_S
    kept, cut = bytearray(), False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return bytes(kept), cut, True
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            room = OUTPUT_LIMIT - len(kept)
            cut = cut or len(chunk) > room
            kept += chunk[:max(room, 0)]
    try:
        proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return bytes(kept), cut, True
    return bytes(kept), cut, False


def _status(returncode: int, timed_out: bool) -> str | None:
    """The last line of the result when the program did not end cleanly (bwrap exits 128 + N for a program that a
    signal N ended), else None."""
    if timed_out:
        return f"killed: over the {TIME_LIMIT_S} s time limit"
    if returncode == 0:
        return None
    number = -returncode if returncode < 0 else returncode - 128
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"exit status {returncode}"
    if sig == signal.SIGXCPU:
        return f"killed: over the {CPU_LIMIT_S} s CPU time limit"
    if sig == signal.SIGXFSZ:
        return f"killed: a file over the {FOLDER_MB} MB limit"
    return f"killed: {sig.name}"


def _report(output: bytes, cut: bool, status: str | None) -> str:
    """The result's text: the output (UTF-8, an invalid byte replaced), a note when it was cut, the status line."""
    text = output.decode("utf-8", "replace")
    notes = ([f"[output cut: only its first {OUTPUT_LIMIT // 1024} KiB are shown]"] if cut else []) + (
        [status] if status else [])
    if notes and text and not text.endswith("\n"):
        text += "\n"
    return text + "\n".join(notes)


def _new_folder() -> str:
    """A new empty folder for a :class:`PythonSandbox`, owned by :data:`SANDBOX_ID` when this process is root (under
    the temporary folder, which bwrap, started as that user, must be able to reach); sweeps the folders of ended
    processes first."""
    for stale in glob.glob(os.path.join(tempfile.gettempdir(), _FOLDER_PREFIX + "*-*")):
        owner = os.path.basename(stale)[len(_FOLDER_PREFIX):].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            _remove(stale)
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
    if os.geteuid() == 0:
        os.chown(folder, SANDBOX_ID, SANDBOX_ID)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(folder: str) -> None:
    """Remove a sandbox's folder, with the folders its program made unreadable (its processes have ended: nothing
    there moves; symbolic links are not followed)."""
    if os.geteuid() != 0:  # root reads them anyway
        for parent, folders, _ in os.walk(folder):
            for name in folders:
                path = os.path.join(parent, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
    shutil.rmtree(folder, ignore_errors=True)
