"""Plugin discovery and calling.

Sources: the ``hfsdp`` entry-point group (hfsdp's own built-ins are registered there too) and dotted module paths
named in the config's ``plugins:`` list. Built-ins marked ``ALWAYS_ON = True`` (the text/instruction/chat formats
and the safetensors export) are always enabled; every other plugin is enabled by naming it in ``plugins:``.
pluggy registers and validates the implementations; :class:`PluginHost` calls them itself, one plugin at a time,
so that a failure names its plugin and hook (pluggy's ``pm.hook`` calling options therefore do not apply).
This module knows nothing of the config schema: ``hfsdp.config`` asks it for the plugins' sections.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pluggy

from hfsdp import hookspecs
from hfsdp.errors import ConfigError, InvalidSectionRead, PluginError, UserError

ENTRY_POINT_GROUP = "hfsdp"


@dataclass
class PluginInfo:
    name: str
    module: ModuleType
    source: str  # "built-in", "entry point (dist x.y)", "path"
    version: str
    always_on: bool = False
    hooks: list[str] = field(default_factory=list)


def discover() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the ``hfsdp`` group, by name (not imported yet, so listing stays cheap)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == "hfsdp" or ep.value.startswith("hfsdp.builtin.")


_HOOK_NAMES = {name for name in dir(hookspecs) if name.startswith("hfsdp_")}


def _check_hook_names(info: PluginInfo) -> None:
    """pluggy silently ignores functions that lack the ``@hookimpl`` marker, and reports a misspelt hook name only as
    "unknown hook": both are a plugin that quietly does nothing, so they are rejected here by name."""
    problems = []
    for attr, value in sorted(vars(info.module).items()):
        if not attr.startswith("hfsdp_") or not callable(value) or getattr(value, "__module__", None) != info.module.__name__:
            continue
        marked = hasattr(value, "hfsdp_impl")
        if attr not in _HOOK_NAMES:
            problems.append((f"plugins.{info.name}", f"function '{attr}' is not an hfsdp hook (misspelt?); "
                                                     f"hooks are: {', '.join(sorted(_HOOK_NAMES))}"))
        elif not marked:
            problems.append((f"plugins.{info.name}", f"function '{attr}' is named like a hook but lacks the "
                                                     "@hfsdp.hookimpl marker, so it would never be called"))
    if problems:
        raise ConfigError(problems)


def _load_entry_point(name: str, ep: importlib.metadata.EntryPoint) -> PluginInfo:
    try:
        module = ep.load()
    except Exception as err:  # a broken third-party install must not look like our crash
        raise ConfigError([("plugins", f"plugin '{name}' failed to import ({ep.value}): {type(err).__name__}: {err}")])
    dist = ep.dist
    builtin = dist is not None and dist.name == "hfsdp"
    version = dist.version if dist is not None else "?"
    source = "built-in" if builtin else f"entry point ({dist.name if dist else '?'})"
    return PluginInfo(name, module, source, version, always_on=builtin and getattr(module, "ALWAYS_ON", False))


def _load_dotted(path: str) -> PluginInfo:
    try:
        module = importlib.import_module(path)
    except Exception as err:
        raise ConfigError(
            [("plugins", f"plugin '{path}' is neither an installed plugin nor an importable module: "
                         f"{type(err).__name__}: {err}. Installed plugins: {', '.join(sorted(discover())) or 'none'}")]
        )
    return PluginInfo(path, module, "path", getattr(module, "__version__", "?"))


class PluginHost:
    """The enabled plugins, in calling order, and per-plugin hook calls that name the plugin when one fails."""

    def __init__(self, enabled: list[str]):
        self.pm = pluggy.PluginManager("hfsdp")
        self.pm.add_hookspecs(hookspecs)
        available = discover()
        # Only hfsdp's own entry points are imported up front (to find the always-on ones); a third-party plugin is
        # imported when enabled, so a broken install of an unused plugin cannot stop other runs.
        builtins = [_load_entry_point(name, ep) for name, ep in available.items() if _is_builtin(ep)]
        self.plugins: list[PluginInfo] = [info for info in builtins if info.always_on]
        by_name = {info.name: info for info in builtins}
        seen = {info.name for info in self.plugins}
        for name in enabled:
            if name in seen:
                continue
            seen.add(name)
            if name in by_name:
                self.plugins.append(by_name[name])
            elif name in available:
                self.plugins.append(_load_entry_point(name, available[name]))
            else:
                self.plugins.append(_load_dotted(name))
        for info in self.plugins:
            _check_hook_names(info)
            try:
                self.pm.register(info.module, name=info.name)
            except pluggy.PluginValidationError as err:
                raise ConfigError([("plugins", f"plugin '{info.name}' does not match the hook specs: {err}")])
            info.hooks = sorted(c.name for c in self.pm.get_hookcallers(info.module) or [])
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as err:
            raise ConfigError([("plugins", f"{err} (hook names must be one of those in hfsdp.hookspecs)")])

    def _impls(self, hook: str) -> list[tuple[str, pluggy.HookImpl]]:
        impls = {impl.plugin_name: impl for impl in getattr(self.pm.hook, hook).get_hookimpls()}
        return [(p.name, impls[p.name]) for p in self.plugins if p.name in impls]

    def implementers(self, hook: str) -> list[str]:
        return [name for name, _ in self._impls(hook)]

    def _call(self, plugin: str, hook: str, impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
        try:
            # Like pluggy itself: an implementation may accept any subset of the spec's arguments.
            return impl.function(*[Lazy.resolve(kwargs[name]) for name in impl.argnames])
        except (UserError, PluginError, InvalidSectionRead):  # a UserError is the user's to fix: exit 2, not a crash
            raise
        except Exception as err:
            raise PluginError(plugin, hook, err) from err

    def call(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation in plugin order; return ``(plugin, result)`` for non-None results."""
        results = []
        for plugin, impl in self._impls(hook):
            result = self._call(plugin, hook, impl, kwargs)
            if result is not None:
                results.append((plugin, result))
        return results

    def chain(self, hook: str, value_arg: str, value: Any, **kwargs: Any) -> Any:
        """Pass ``value`` through every implementation; a None result keeps the value."""
        for plugin, impl in self._impls(hook):
            result = self._call(plugin, hook, impl, {value_arg: value, **kwargs})
            if result is not None:
                value = result
        return value

    # Typed helpers for the hooks whose results need merging.

    def config_sections(self) -> dict[str, tuple[str, type]]:
        """Section name → (plugin, pydantic model class) of the enabled plugins."""
        from pydantic import BaseModel

        sections: dict[str, tuple[str, type]] = {}
        for plugin, declared in self.call("hfsdp_config_section"):
            if not (isinstance(declared, tuple) and len(declared) == 2 and isinstance(declared[0], str)
                    and isinstance(declared[1], type) and issubclass(declared[1], BaseModel)):
                raise ConfigError([(f"plugins.{plugin}", "hfsdp_config_section must return (section_name, "
                                                         f"pydantic model class) or None, got {declared!r}")])
            name, schema = declared
            if name in sections:
                raise ConfigError([(name, f"section claimed by two plugins: '{sections[name][0]}' and '{plugin}'")])
            sections[name] = (plugin, schema)
        return sections

    def section_of(self, plugin: str, config: Any) -> Any:
        """The validated config section of ``plugin`` (None when it declares none)."""
        names = [name for name, (owner, _) in self.config_sections().items() if owner == plugin]
        return config.section(names[0]) if names else None

    def validation_problems(self, config: Any) -> list[tuple[str, str]]:
        """Every enabled plugin's ``hfsdp_validate_config`` problems; a plugin whose check reads a section that
        failed validation is skipped (that section's problems are reported already)."""
        problems: list[tuple[str, str]] = []
        for plugin, impl in self._impls("hfsdp_validate_config"):
            try:
                problems += self._call(plugin, "hfsdp_validate_config", impl, {"config": config}) or []
            except InvalidSectionRead:
                continue
            except ConfigError as err:
                problems += err.problems
        return problems

    def dataset_formats(self) -> dict[str, tuple[str, Callable[..., Any]]]:
        formats: dict[str, tuple[str, Callable[..., Any]]] = {}
        for plugin, registered in self.call("hfsdp_dataset_formats"):
            for name, fn in registered.items():
                if name in formats:
                    raise ConfigError(
                        [("data.format", f"format '{name}' is registered by two plugins: "
                                         f"'{formats[name][0]}' and '{plugin}'; disable one of them")]
                    )
                formats[name] = (plugin, fn)
        return formats

    def tokenize_function(self, config: Any, name: str | None = None) -> tuple[str, Callable[..., Any]]:
        """(plugin, tokenize) of the format ``name`` (default ``data.format``), given its plugin's section if it
        takes ``section``."""
        plugin, fn = self.dataset_formats()[name or config.data.format]
        return plugin, WithSection(fn, self.section_of(plugin, config))

    def data_readers(self, config: Any = None) -> dict[str, tuple[str, Callable[..., Any]]]:
        """File suffix or source prefix → (plugin, read); with ``config``, each read gets its plugin's section."""
        readers: dict[str, tuple[str, Callable[..., Any]]] = {}
        for plugin, registered in self.call("hfsdp_data_readers"):
            for key, fn in registered.items():
                if not isinstance(key, str) or not (key.startswith(".") or key.endswith("://")) or not callable(fn):
                    raise ConfigError([(f"plugins.{plugin}", f"hfsdp_data_readers: {key!r}: keys are file suffixes "
                                                             "('.tsv') or source prefixes ('mydb://'), values functions")])
                clash = next((k for k in readers if k.lower() == key.lower()), None)
                if clash is not None:
                    raise ConfigError([("data.path", f"'{key}' is read by two plugins: '{readers[clash][0]}' and "
                                                     f"'{plugin}'; disable one of them")])
                readers[key] = (plugin, WithSection(fn, self.section_of(plugin, config)) if config is not None else fn)
        return readers

    def export(self, *, out_dir: Any, destination: Any, config: Any, **kwargs: Any) -> str:
        """``hfsdp_export`` into the staged folder ``out_dir`` (first truthy result; the built-in safetensors export,
        marked ``trylast``, is asked last), then ``hfsdp_on_export`` on the written folder, before it is renamed to
        ``destination``. Main process only. Returns the name of the plugin that wrote the export."""
        impls = self._impls("hfsdp_export")
        ordered = [i for i in impls if not i[1].trylast] + [i for i in impls if i[1].trylast]
        for plugin, impl in ordered:
            if self._call(plugin, "hfsdp_export", impl, {"out_dir": out_dir, "config": config, **kwargs}):
                self.call("hfsdp_on_export", out_dir=Path(out_dir), destination=Path(destination), config=config,
                          written_by=plugin, model_config=kwargs["model_config"], tokenizer=kwargs["tokenizer"])
                return plugin
        raise UserError("export: no plugin wrote the model (every hfsdp_export implementation returned nothing)")


class Lazy:
    """A hook argument computed the first time an implementation asks for it (then kept): e.g. ``hfsdp export``
    loads the transformers config and tokenizer only for plugins that take them."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._value: Any = None
        self._made = False

    @staticmethod
    def resolve(value: Any) -> Any:
        if isinstance(value, Lazy):
            if not value._made:
                value._value, value._made = value._make(), True
            return value._value
        return value


class WithSection:
    """A plugin's tokenize function or data reader, called with the plugin's validated config section as
    ``section=`` when it declares that parameter (older functions without it are called as before). Picklable, so
    that ``datasets`` can run it in worker processes."""

    def __init__(self, fn: Callable[..., Any], section: Any):
        self.fn = fn
        self.section = section
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # no introspectable signature: call it the way hfsdp always did
            params = []
        self.wants_section = any(p.name == "section" or p.kind is p.VAR_KEYWORD for p in params)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args, section=self.section) if self.wants_section else self.fn(*args)


def installed_sections() -> dict[str, tuple[str, type]]:
    """Section name → (plugin, schema) of every installed plugin, enabled or not (for messages and the reference).
    Plugins that fail to import are left out: this only informs, it never stops a run."""
    sections: dict[str, tuple[str, type]] = {}
    for name, ep in sorted(discover().items()):
        try:
            module = ep.load()
            declare = getattr(module, "hfsdp_config_section", None)
            declared = declare() if callable(declare) and hasattr(declare, "hfsdp_impl") else None
        except Exception:  # noqa: BLE001 (a broken plugin is reported when it is enabled or listed)
            continue
        if isinstance(declared, tuple) and len(declared) == 2 and isinstance(declared[0], str):
            sections.setdefault(declared[0], (name, declared[1]))
    return sections
