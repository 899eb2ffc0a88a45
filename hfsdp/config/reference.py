"""The configuration reference as Markdown, generated from the schemas: the core sections and every plugin section
(``hfsdp config-reference [SECTION]``; ``scripts/reference_docs.py`` writes docs/configuration.md), and the hook
reference from ``hfsdp.hooks.specs`` (docs/hooks.md)."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from hfsdp.config.schema import HfsdpConfig


def _type_name(annotation: typing.Any) -> str:
    text = str(annotation).replace("typing.", "").replace("hfsdp.config.schema.", "")
    text = text.replace("<class '", "").replace("'>", "").replace("NoneType", "null")
    module = getattr(annotation, "__module__", "")
    return text.replace(f"{module}.", "") if module and isinstance(annotation, type) else text


def _default(field) -> str:
    return "required" if field.is_required() else repr(field.get_default(call_default_factory=True))


def section_reference(name: str, model: type[BaseModel], plugin: str | None = None) -> list[str]:
    """One section's table: key, type, default, meaning (the field descriptions)."""
    heading = f"### `{name}`" + (f" (plugin `{plugin}`: enable with `plugins: [{plugin}]`)" if plugin else "")
    lines = [heading, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, field in model.model_fields.items():
        cells = [f"`{name}.{key}`", f"`{_type_name(field.annotation)}`", f"`{_default(field)}`", field.description or ""]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # GFM: \| inside a cell
    return lines + [""]


def core_sections() -> dict[str, type[BaseModel] | None]:
    """Core section name → its model (None for a plain value such as ``plugins``), in schema order."""
    out: dict[str, type[BaseModel] | None] = {}
    for key, field in HfsdpConfig.model_fields.items():
        if key == "plugin_config":
            continue
        annotation = field.annotation
        out[key] = next((a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None)
    return out


def core_reference(only: str | None = None) -> list[str]:
    out = []
    for key, model in core_sections().items():
        if only is not None and key != only:
            continue
        if model is not None:
            out += section_reference(key, model)
        else:
            field = HfsdpConfig.model_fields[key]
            out += [f"### `{key}`", "", f"`{_type_name(field.annotation)}`: {field.description}", ""]
    return out


def plugin_reference(sections: dict[str, tuple[str, type[BaseModel]]], only: str | None = None) -> list[str]:
    """Tables of plugin sections (section name → (plugin, schema)), sorted by section name."""
    out = []
    for name, (plugin, schema) in sorted(sections.items()):
        if only is None or name == only:
            out += section_reference(name, schema, plugin)
    return out


def _markdown(docstring: str) -> str:
    """A hook spec's docstring as Markdown: reST literals and roles as code spans."""
    import inspect
    import re

    text = inspect.cleandoc(docstring)
    text = re.sub(r":(?:class|func|meth|mod):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def hook_reference() -> list[str]:
    """Every hook of ``hfsdp.hooks.specs``, in the order it declares them: signature and specification."""
    import inspect

    from hfsdp.hooks import specs
    from hfsdp.hooks.host import CHAINED

    lines = []
    for name, spec in vars(specs).items():
        if not (name.startswith("hfsdp_") and callable(spec)):
            continue
        chained = " (chained)" if name in CHAINED else ""
        lines += [f"## `{name}{inspect.signature(spec)}`{chained}", "", _markdown(spec.__doc__ or ""), ""]
    return lines
