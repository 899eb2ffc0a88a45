"""The tree passes ruff with the rules pyproject.toml configures (pyflakes, pycodestyle; ``make lint`` runs the
same). The ``ruff`` binary comes with the test extra; a missing one is a failure, not a skip. And the suite, as
pyproject.toml configures pytest, leaves no files behind when it passes (its runs fill gigabytes of a shared disk)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_ruff_passes():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.is_file(), "ruff not found next to the interpreter: pip install -e '.[test]'"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_passing_session_leaves_no_files_and_a_failing_one_keeps_its_failures_only(tmp_path):
    """pytest with the project's configuration, on a file of one passing and one failing test that each write to
    their ``tmp_path``, then on the passing test alone: what stays under pytest's temporary root."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_disk.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'passed.bin').write_bytes(bytes(1000))\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'failed.bin').write_bytes(bytes(1000))\n    assert False\n")
    root = tmp_path / "temproot"
    root.mkdir()
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(root), "PYTEST_ADDOPTS": ""}

    def session(*selection: str) -> set[str]:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), *selection],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return {f.name for f in root.rglob("*.bin")}

    assert session(str(tests)) == {"failed.bin"}
    assert session(f"{tests}/test_disk.py::test_passes") == {"failed.bin"}  # the earlier failing session's, kept once
