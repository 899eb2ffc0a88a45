"""Config files → one validated config: YAML read as text (with clear errors for what is not YAML text), the bundled
presets, ``base:`` chains merged key by key, relative data paths anchored to the file that names them, ``--set``
overrides, then :func:`load_config` validates the result by its schemas (``hfsdp.config.schema``, and the sections of
the plugins it enables). The rules across sections are the rule table's (:mod:`hfsdp.rules.table`), which runs after.
Imports neither torch nor transformers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from hfsdp.hooks import host as plugin_host
from hfsdp.config.data_paths import DATA_SUFFIXES, is_glob
from hfsdp.config.schema import HfsdpConfig
from hfsdp.config.validate import validate_config
from hfsdp.errors import ConfigError


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError([("", f"{path} is a folder, not a config file (give a YAML file or a preset name)")])
    if not path.is_file():
        raise ConfigError([("", f"config file not found: {path} (give a YAML file or a preset name, see `hfsdp presets`)")])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([("", f"not a text file: byte {err.start} is not UTF-8; a config is a YAML text file")],
                          source=str(path)) from None
    except OSError as err:
        raise ConfigError([("", f"cannot read the config file: {err.strerror}")], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([("", f"malformed YAML{where}: {getattr(err, 'problem', err)}")], source=str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the top level must be a mapping of sections, got {type(data).__name__}")], str(path))
    return data


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set a.b.c=value`` overrides; values are parsed as YAML so they get the schema's types."""
    raw = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append((item, "overrides look like --set section.key=value"))
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append((key, f"'{part}' is not a section"))
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, source="--set")
    return raw


PRESET_DIR = Path(__file__).parent / "presets"


def list_presets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))}


def resolve_config_path(name_or_path: str | None) -> Path:
    """A YAML path, or the name of a bundled preset (``None`` means the ``default`` preset)."""
    if name_or_path is None:
        return list_presets()["default"]
    path = Path(name_or_path)
    if path.is_file() or path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        return path
    presets = list_presets()
    if name_or_path in presets:
        return presets[name_or_path]
    raise ConfigError([("", f"'{name_or_path}' is neither a config file nor a preset; presets: {', '.join(presets)}")])


def _anchor_data_paths(raw: dict[str, Any], base: Path) -> None:
    """The one rule for relative data paths (and a ``data.chat_template`` file) written in a config file: they are
    relative to that file's folder
    (never to the working directory). A relative value that names nothing there and does not look like a file
    (no data suffix, no leading ``.``/``~``, nothing of that name in the working directory either) is left as it
    is: a datasets name. Paths given with ``--set`` are applied after this, relative to the working directory."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    entries = [(data, key) for key in ("path", "eval_path", "chat_template")]
    if isinstance(data.get("datasets"), list):
        entries += [(source, "path") for source in data["datasets"] if isinstance(source, dict)]
    for holder, key in entries:
        value = holder.get(key)
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        suffixes = (".jinja",) if key == "chat_template" else DATA_SUFFIXES  # a template's other values are names
        looks_local = value.startswith((".", "~")) or Path(value).suffix.lower() in suffixes or (
            key != "chat_template" and is_glob(value))
        if (base / value).exists() or looks_local or Path(value).exists():
            holder[key] = str((base / value).resolve())


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``: mappings merge key by key, anything else (values, lists, null) replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_config(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file as raw data, with its ``base:`` (a preset name, or a file relative to this one) merged under
    it; data paths are anchored to the folder of the file that names them."""
    raw = read_yaml(path)
    _anchor_data_paths(raw, path.parent)
    if "base" not in raw:
        return raw
    base = raw.pop("base")
    chain = (*_chain, path.resolve())
    if not isinstance(base, str) or not base:
        raise ConfigError([("base", "give a preset name or a config file path")], source=str(path))
    base_path = path.parent / base
    if not base_path.is_file():
        presets = list_presets()
        if base not in presets:
            raise ConfigError([("base", f"'{base}' is neither a config file ({base_path} does not exist) nor a "
                                        f"preset; presets: {', '.join(presets)}")], source=str(path))
        base_path = presets[base]
    if base_path.resolve() in chain:
        raise ConfigError([("base", "configs name each other as base: "
                                    + " -> ".join(str(p) for p in (*chain, base_path.resolve())))], source=str(path))
    return _merge(read_config(base_path, chain), raw)


def load_config(name_or_path: str | None, overrides: list[str] = ()) -> tuple[HfsdpConfig, plugin_host.PluginHost]:
    """Read, override and validate a config by its schemas (the core's and the enabled plugins' sections), enabling
    the plugins it names: ConfigError with every problem they find. Nothing heavy is imported. The rules across
    sections, and against the data, the world and the model, are the rule table's
    (:func:`hfsdp.rules.table.load_checked` does both)."""
    config, host, problems = validated_config(name_or_path, overrides)
    if problems:
        raise ConfigError(problems, source=str(resolve_config_path(name_or_path))).blamed_on(list(overrides))
    return config, host


def validated_config(name_or_path: str | None, overrides: list[str] = ()
                     ) -> tuple[HfsdpConfig, plugin_host.PluginHost, list[tuple[str, str]]]:
    """The config as :func:`load_config` reads it, and its schemas' problems instead of an error: a section with
    problems stands in as :class:`hfsdp.config.validate.InvalidSection`, so that the rule table can check the rest
    and report every problem at once (:func:`hfsdp.rules.table.enforce`'s ``found``)."""
    path = resolve_config_path(name_or_path)
    return validate_raw(apply_overrides(read_config(path), list(overrides)), str(path))


def with_plugins(config: HfsdpConfig, plugins: list[str]) -> tuple[HfsdpConfig, plugin_host.PluginHost]:
    """``config`` with ``plugins`` enabled instead of its own (a new plugin's section at its defaults), validated
    again as :func:`load_config` would (ConfigError): what ``hfsdp plan`` tries when it suggests a plugin."""
    config, host, problems = validate_raw({**config.to_yaml_dict(), "plugins": list(plugins)}, "config")
    if problems:
        raise ConfigError(problems, source="config")
    return config, host


def validate_raw(raw: dict[str, Any], source: str
                 ) -> tuple[HfsdpConfig, plugin_host.PluginHost, list[tuple[str, str]]]:
    """Raw config data (``base:`` merged, overrides applied) validated with the plugins it enables: the config, the
    plugin host and every problem, each tied to its key (ConfigError for a ``plugins:`` list that names no plugins,
    in ``source``)."""
    enabled = raw.get("plugins") or []
    if not isinstance(enabled, list) or not all(isinstance(p, str) for p in enabled):
        raise ConfigError([("plugins", "must be a list of plugin names or dotted module paths")], source)
    host = plugin_host.PluginHost(enabled)
    config, problems = validate_config(raw, host.config_sections())
    return config, host, problems
