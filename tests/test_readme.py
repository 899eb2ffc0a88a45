"""The docs stay true: the generated references are the schemas' and the hook specs', and the README's quickstart
commands exist."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, run_cli


def test_generated_references_are_up_to_date():
    """docs/configuration.md and docs/hooks.md are exactly what scripts/reference_docs.py writes (a hand edit, a
    new key or hook without regenerating, or a block pasted twice all fail)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "reference_docs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    hooks = (REPO / "docs" / "hooks.md").read_text()
    from hfsdp.hooks import specs as hookspecs

    for name in (n for n in vars(hookspecs) if n.startswith("hfsdp_")):
        assert hooks.count(f"## `{name}(") == 1, name


def test_quickstart_targets_exist_and_ci_runs_readme_test_command():
    readme = (REPO / "README.md").read_text()
    quickstart = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in quickstart.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_architecture_names_every_module():
    """docs/architecture.md (generated, checked above) names every package of hfsdp/ and every module in it (a
    folder that is no package holds data another program reads: lm-eval's task files in tools/eval_tasks/)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    package = REPO / "hfsdp"
    missing = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.name != "__init__.py" and p.parent != package and (p.parent / "__init__.py").is_file()
               and (f"## `hfsdp/{p.parent.relative_to(package)}/`" not in text or f"`{p.name}`" not in text)]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"
    assert "README.md" not in text and "docs/architecture.md" in (REPO / "README.md").read_text()


@pytest.mark.slow
def test_a_run_ends_with_the_lines_the_readme_shows_for_make_demo(tmp_path):
    """The README's `make demo` ending (after its '...'): the default preset's run folder, as a 2-step tiny run
    into the same folder prints it (the lines before depend on the real model, trained for minutes)."""
    readme = (REPO / "README.md").read_text()
    ending = re.search(r"It ends with:\n\n```\n(.*?)```", readme, re.S).group(1).split("...\n")[1].splitlines()
    proc = run_cli("train", "tiny", "--set", "train.max_steps=2", "--set", "train.output_dir=runs/default",
                   "--set", "train.save_every=null", "--set", "train.loss_plot=true", cwd=tmp_path)
    assert proc.stdout.splitlines()[-len(ending):] == ending, proc.stdout[-2000:]
