"""``python -m launch_probe OUT``: what the process was started with, as JSON in ``OUT/<RANK or 0>.json`` (its
environment, argv, the first sys.path entry, working directory, stdio buffering, ``__main__``): for
tests/test_launch.py, which starts it as a fresh process or torchrun worker and forked from tests/fork_server.py."""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    out = Path(sys.argv[1])
    facts = {"env": dict(os.environ), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
             "main": sys.modules["__main__"].__file__, "stdout_write_through": sys.stdout.write_through,
             "stdout_line_buffering": sys.stdout.line_buffering, "stderr_line_buffering": sys.stderr.line_buffering,
             "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)) if os.path.exists(os.devnull) else None,
             "stdout_is_tty": sys.stdout.isatty(), "threads": len(os.listdir("/proc/self/task"))}
    (out / f"{os.environ.get('RANK', '0')}.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    print(f"probe {os.environ.get('RANK', '0')} done")
    if os.environ.get("HFSDP_TEST_PROBE_EXIT_RANK") == os.environ.get("RANK", "0"):
        print("probe failing on purpose", file=sys.stderr)
        sys.exit(3)
