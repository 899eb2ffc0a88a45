"""Write the generated references: docs/configuration.md (every config key, from the schemas: the core sections,
then the sections of hfsdp's own plugins), docs/hooks.md (every hook, from hfsdp/hooks/specs.py) and
docs/architecture.md (a paragraph per package, from the packages' own docstrings, with the modules in each).

Run: python scripts/reference_docs.py           (rewrites the three files)
     python scripts/reference_docs.py --check   (exit 1 if one is out of date; tests/test_readme.py runs it)
`hfsdp config-reference` prints the configuration reference for the plugins installed where it runs."""

import ast
import tomllib
import re
import sys
from pathlib import Path

from hfsdp.hooks.host import installed_sections
from hfsdp.config.reference import core_reference, hook_reference, plugin_reference

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# The packages in the order a run meets them; every package of hfsdp/ must be named here (a new one fails --check).
PACKAGES = ["config", "hooks", "disk", "layout", "rules", "setup", "data", "model", "parallel", "checkpoint", "export",
            "run", "run/sharded", "tools", "tools/plan", "builtin", "builtin/text", "builtin/instruction",
            "builtin/chat", "builtin/preference", "builtin/unpaired", "builtin/prompt", "builtin/packing",
            "builtin/lora", "builtin/dpo", "builtin/orpo", "builtin/simpo", "builtin/grpo", "builtin/rloo",
            "builtin/reward_model", "builtin/kto", "builtin/distill", "builtin/distill_online",
            "builtin/safetensors_export", "builtin/gguf_export", "builtin/bench_probe", "builtin/online",
            "builtin/reference_model", "builtin/reference_free", "builtin/agent"]
FLOW = """\
# Architecture

Generated from the packages' docstrings by `python scripts/reference_docs.py`; do not edit by hand.

One way through a run: YAML → a config validated by its schemas (`hfsdp.config`, torch-free) → the rule table
(`hfsdp.rules.table.enforce`: every check, by phase: the config alone, its data, the world and its parallel degrees,
`hfsdp.layout`, a trial of its values on torch, the model's architecture) → one decided run
(`hfsdp.setup.decide.decide`: the effective config, the degrees and the wrapper they make, the resume point, decided
once, before any weight loads) → pure builders (`hfsdp.parallel`, `hfsdp.model`, one device mesh from the degrees) →
the `Accelerator` → the loop (`hfsdp.run.loop`, its step in `hfsdp.run.step`). `hfsdp train` enters `hfsdp.config`,
`hfsdp.rules` and `hfsdp.setup` once each, in that order. Only `hfsdp/cli.py` reads argv and the environment;
plugins, first-party ones included, reach the run through the hooks of `hfsdp.hooks` (their rules through
`hfsdp_rules`) and get what they need as arguments.

At the top of `hfsdp/`: `cli.py` (the commands, exit codes), `errors.py` (`UserError`, `ConfigError`: one screen,
exit 2), `objective.py` (the objective protocol plugins implement: `Objective`, `PreferenceObjective`), `units.py`
(byte units, dtype sizes), `compat.py` (the documented former module paths, still importable), and in `__init__.py`
`hfsdp.hookimpl`.
"""


def configuration() -> str:
    builtin = {name: owner for name, owner in installed_sections().items() if owner[1].__module__.startswith("hfsdp.")}
    lines = ["# Configuration reference", "",
             "Generated from the schemas by `python scripts/reference_docs.py`; do not edit by hand. `hfsdp "
             "config-reference [SECTION]` prints the same, plus the sections of the plugins installed where it runs.",
             "", "## Core sections", ""]
    lines += core_reference() + ["## Sections of hfsdp's own plugins", ""] + plugin_reference(builtin)
    return "\n".join(lines).rstrip() + "\n"


def hooks() -> str:
    lines = ["# Hook reference", "",
             "Generated from `hfsdp/hooks/specs.py` by `python scripts/reference_docs.py`; do not edit by hand. How to "
             "write, package and test a plugin: [plugins.md](plugins.md).", ""]
    return "\n".join(lines + hook_reference()).rstrip() + "\n"


def _docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path} has no docstring: architecture.md is made of them")
    return doc


def architecture() -> str:
    root = REPO / "hfsdp"
    found = sorted(str(p.parent.relative_to(root)) for p in root.rglob("__init__.py") if p.parent != root)
    if sorted(PACKAGES) != found:
        raise SystemExit(f"PACKAGES in {Path(__file__).name} must list hfsdp's packages: {', '.join(found)}")
    lines = [FLOW, "## Layers", "",
             "Bottom first, as `pyproject.toml` writes them down (`[[tool.hfsdp.layers]]`); `tests/test_architecture.py` "
             "fails on an import that points up (imports inside functions and under `TYPE_CHECKING` count):", ""]
    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hfsdp"]["layers"]
    lines += [f"{i}. {layer['name']}: " + ", ".join(f"`{m}`" for m in layer["modules"])
              for i, layer in enumerate(layers, 1)] + [""]
    for package in PACKAGES:
        folder = root / package
        modules = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
        subpackages = sorted(p.parent.name for p in folder.glob("*/__init__.py"))
        first = _docstring(folder / "__init__.py").split("\n\n")[0]  # its first paragraph, in Markdown
        text = re.sub(r":(?:mod|class|func|meth):`~?([^`]+)`", r"`\1`", " ".join(first.split())).replace("``", "`")
        lines += [f"## `hfsdp/{package}/`", "", text, ""]
        parts = [f"`{m}.py`" for m in modules] + [f"`{p}/`" for p in subpackages]
        if parts:
            lines += [f"In it: {', '.join(parts)}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(check: bool) -> int:
    stale = []
    for name, text in (("configuration.md", configuration()), ("hooks.md", hooks()),
                       ("architecture.md", architecture())):
        path = DOCS / name
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run: python scripts/reference_docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
