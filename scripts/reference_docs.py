"""Write the generated references: docs/configuration.md (every config key, from the schemas: the core sections,
then the sections of hfsdp's own plugins) and docs/hooks.md (every hook, from hfsdp/hooks/specs.py).

Run: python scripts/reference_docs.py           (rewrites both files)
     python scripts/reference_docs.py --check   (exit 1 if either is out of date; tests/test_readme.py runs it)
`hfsdp config-reference` prints the configuration reference for the plugins installed where it runs."""

import sys
from pathlib import Path

from hfsdp.hooks.host import installed_sections
from hfsdp.config.reference import core_reference, hook_reference, plugin_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"


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


def main(check: bool) -> int:
    stale = []
    for name, text in (("configuration.md", configuration()), ("hooks.md", hooks())):
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
