"""The README stays true: its configuration reference is the schema's, and its quickstart commands exist."""

import re
import subprocess
import sys

from conftest import REPO


def test_config_reference_matches_schema():
    generated = subprocess.run([sys.executable, str(REPO / "scripts" / "config_reference.py")],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert generated in (REPO / "README.md").read_text(), "run: python scripts/config_reference.py and paste it"


def test_quickstart_targets_exist_and_ci_runs_readme_test_command():
    readme = (REPO / "README.md").read_text()
    quickstart = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in quickstart.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
