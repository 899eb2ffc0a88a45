"""Print the configuration reference (Markdown) for the README: the core sections, then the sections of hfsdp's
own plugins (lora, packing). Run: python scripts/config_reference.py  (`hfsdp config-reference` prints the same
for the plugins installed where it runs)."""

from hfsdp.plugins import installed_sections
from hfsdp.reference import core_reference, plugin_reference


def main() -> None:
    builtin = {name: owner for name, owner in installed_sections().items() if owner[1].__module__.startswith("hfsdp.")}
    lines = core_reference() + ["### Sections of hfsdp's own plugins", ""] + plugin_reference(builtin)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
