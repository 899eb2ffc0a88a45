"""The tree passes ruff with the rules pyproject.toml configures (pyflakes, pycodestyle; ``make lint`` runs the
same). The ``ruff`` binary comes with the test extra; a missing one is a failure, not a skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_ruff_passes():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.is_file(), "ruff not found next to the interpreter: pip install -e '.[test]'"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
