"""Validation of a raw config by its schemas: every problem at once, the core sections', the plugin sections' (each
by the schema its plugin declares; a section of an installed plugin that is not enabled names the plugin to enable).
The rules across sections are :mod:`hfsdp.rules.table`'s ``config`` phase; reading config files is
:mod:`hfsdp.config.files`, which runs both.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from hfsdp.config.schema import CORE_SECTIONS, HfsdpConfig
from hfsdp.errors import InvalidSectionRead
from hfsdp.hooks import host as plugin_host


def _submodel(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The section model of field ``name`` (also inside ``X | None`` and other unions), if it is one."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _unknown_key(model: type[BaseModel], loc: list[str], reference: str) -> str:
    """'unknown key', with the closest valid key of that (sub)section and the command that prints them all."""
    for part in loc[:-1]:
        model = _submodel(model, part) or model
    keys = [k for k in model.model_fields if k != "plugin_config"]
    # a close spelling, else a key the unknown one abbreviates (model.name -> name_or_path)
    close = difflib.get_close_matches(loc[-1], keys, n=1) or [k for k in keys if k.startswith(f"{loc[-1]}_")][:1]
    maybe = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key ({maybe}`{reference}` lists the valid keys)"


def _pydantic_problems(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None,
                       plugin: str | None = None) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).startswith(("function-after", "function-before"))]
        # Union members add their type name to the path; drop it so the path is the YAML path.
        loc = [p for p in loc if p not in ("str", "MixedPrecisionParts", "literal['no','bf16','fp16']")]
        path = ".".join(filter(None, [prefix, *loc]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = path.split(".")[0]
            reference = f"hfsdp config-reference {section}" + (f" --enable {plugin}" if plugin else "")
            msg = _unknown_key(model or HfsdpConfig, loc, reference)
        elif e["type"] == "missing":
            msg = "required key is missing" + (" (or start from a preset that has it: `base: default`; "
                                               "`hfsdp presets` lists them)" if len(loc) == 1 and not prefix else "")
        elif "input" in e and e["type"] not in ("value_error",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        problems.append((path, msg))
    return problems


class InvalidSection:
    """Stands in for a section that failed validation (its problems are reported), so that plugin checks that do
    not read it still run; reading it raises :class:`InvalidSectionRead`, which skips the check that did."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise InvalidSectionRead(self._name)

    def __repr__(self) -> str:
        return f"<invalid section {self._name}>"


def _core_config(core: dict[str, Any]) -> tuple[HfsdpConfig, list[tuple[str, str]]]:
    """The core sections; a section with problems becomes an :class:`InvalidSection` (see there)."""
    try:
        return HfsdpConfig.model_validate(core), []
    except ValidationError as err:
        problems = _pydantic_problems(err)
        broken = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    values: dict[str, Any] = {}
    for name, field in HfsdpConfig.model_fields.items():
        if name in broken:
            values[name] = InvalidSection(name)
        elif name in core:
            values[name] = TypeAdapter(field.annotation).validate_python(core[name])
        else:
            values[name] = field.get_default(call_default_factory=True)
    return HfsdpConfig.model_construct(**values), problems


def validate_config(
    raw: dict[str, Any], plugin_sections: dict[str, tuple[str, type[BaseModel]]],
) -> tuple[HfsdpConfig, list[tuple[str, str]]]:
    """Validate raw YAML data: the config (sections with problems stand in as :class:`InvalidSection`) and the
    problems. ``plugin_sections`` maps section name → (plugin, schema) for the enabled plugins."""
    problems: list[tuple[str, str]] = []
    plugin_config: dict[str, Any] = {}
    unknown = []
    for name, (plugin, _) in list(plugin_sections.items()):
        if name in CORE_SECTIONS or name == "plugin_config":
            problems.append((name, f"plugin '{plugin}' declares section '{name}', which is a core section"))
            plugin_sections = {k: v for k, v in plugin_sections.items() if k != name}
    for key in raw:
        if key in CORE_SECTIONS:
            continue
        if key == "plugin_config":
            problems.append((key, "unknown key: plugin sections go at the top level under their own name"))
        elif key not in plugin_sections:
            unknown.append(key)
    if unknown:
        owners = {name: plugin for name, (plugin, _) in plugin_host.installed_sections().items()}
        for key in unknown:
            if key in owners:
                problems.append((key, f"section of plugin '{owners[key]}', which is not enabled: enable plugin "
                                      f"'{owners[key]}' (add it to `plugins:`)"))
            else:
                close = difflib.get_close_matches(key, sorted(CORE_SECTIONS | set(plugin_sections) | set(owners)), n=1)
                problems.append((key, "unknown section" + (f" (did you mean '{close[0]}'?)" if close else "")
                                 + f"; valid sections: {', '.join(sorted(CORE_SECTIONS | set(plugin_sections)))}"))
    # Enabled plugins with a section get their defaults even when the YAML omits the section.
    for name, (plugin, schema) in plugin_sections.items():
        try:
            plugin_config[name] = schema.model_validate(raw.get(name) or {})
        except ValidationError as err:
            plugin_config[name] = InvalidSection(name)
            problems += [(path, f"{msg} [section of plugin '{plugin}']")
                         for path, msg in _pydantic_problems(err, prefix=name, model=schema, plugin=plugin)]
    config, core_problems = _core_config({k: v for k, v in raw.items() if k in CORE_SECTIONS})
    config.plugin_config = plugin_config
    return config, core_problems + problems
