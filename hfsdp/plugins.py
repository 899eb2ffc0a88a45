"""Plugin discovery and calling.

Sources: the ``hfsdp`` entry-point group (hfsdp's own built-ins are registered there too) and dotted module paths
named in the config's ``plugins:`` list. Built-ins marked ``ALWAYS_ON = True`` (the text/instruction/chat formats
and the safetensors export) are always enabled; every other plugin is enabled by naming it in ``plugins:``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import pluggy

from hfsdp import hookspecs
from hfsdp.errors import ConfigError, PluginError, UserError

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
        self.section_owners: dict[str, str] = {}
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
            return impl.function(*[kwargs[name] for name in impl.argnames])
        except (UserError, PluginError):  # a UserError is the user's to fix: reported as such (exit 2), not as a crash
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

    def first(self, hook: str, **kwargs: Any) -> Any:
        """First truthy result; built-ins marked ``trylast`` (the default export) are asked last."""
        impls = self._impls(hook)
        ordered = [i for i in impls if not i[1].trylast] + [i for i in impls if i[1].trylast]
        for plugin, impl in ordered:
            result = self._call(plugin, hook, impl, kwargs)
            if result:
                return result
        return None

    def chain(self, hook: str, value_arg: str, value: Any, **kwargs: Any) -> Any:
        """Pass ``value`` through every implementation; a None result keeps the value."""
        for plugin, impl in self._impls(hook):
            result = self._call(plugin, hook, impl, {value_arg: value, **kwargs})
            if result is not None:
                value = result
        return value

    # Typed helpers for the hooks whose results need merging.

    def config_sections(self) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        owners: dict[str, str] = {}
        from pydantic import BaseModel

        from hfsdp.config import CORE_SECTIONS

        for plugin, declared in self.call("hfsdp_config_section"):
            if not (isinstance(declared, tuple) and len(declared) == 2 and isinstance(declared[0], str)
                    and isinstance(declared[1], type) and issubclass(declared[1], BaseModel)):
                raise ConfigError([(f"plugins.{plugin}", "hfsdp_config_section must return (section_name, "
                                                         f"pydantic model class) or None, got {declared!r}")])
            name, schema = declared
            if name in CORE_SECTIONS or name == "plugin_config":
                raise ConfigError([(name, f"plugin '{plugin}' declares section '{name}', which is a core section")])
            if name in sections:
                raise ConfigError([(name, f"section claimed by two plugins: '{owners[name]}' and '{plugin}'")])
            sections[name], owners[name] = schema, plugin
        self.section_owners = owners
        return sections

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

