"""Plugin discovery and calling.

Sources: the ``hfsdp`` entry-point group (hfsdp's own built-ins are registered there too, like any plugin) and
dotted module paths named in the config's ``plugins:`` list. Built-ins marked ``ALWAYS_ON = True`` (the
text/instruction/chat formats and the safetensors export) are always enabled; every other plugin is enabled by
naming it in ``plugins:``. pluggy registers, orders and calls the implementations (``tryfirst``/``trylast`` and
hook wrappers work as pluggy documents); each implementation is registered behind a guard that names its plugin
and hook when it fails. Chained hooks pass each result on, in pluggy's order.
This module knows nothing of the config schema: ``hfsdp.config.schema`` asks it for the plugins' sections.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable

import pluggy

from hfsdp.hooks import specs
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
    """hfsdp's own plugins: the entry points hfsdp's distribution declares."""
    return ep.dist is not None and ep.dist.name == "hfsdp"


_HOOK_NAMES = {name for name in dir(specs) if name.startswith("hfsdp_")}


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
    builtin = _is_builtin(ep)
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


# Hooks whose implementations hand their result to the next one (see hfsdp.hooks.specs): called in pluggy's order.
CHAINED = ("hfsdp_transform_dataset", "hfsdp_modify_model")
_PASSED_THROUGH = (UserError, PluginError, InvalidSectionRead)  # the user's to fix (exit 2), or already named


class PluginHost:
    """The enabled plugins and their hook calls through pluggy, each failure naming its plugin and hook."""

    def __init__(self, enabled: list[str]):
        self.pm = pluggy.PluginManager("hfsdp")
        self.pm.add_hookspecs(specs)
        self._recording: list[list[tuple[str, Any]]] = []  # (plugin, result) of the calls in progress
        self._sections: dict[str, tuple[str, type]] | None = None
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
        # pluggy calls the last registered first: registering in reverse keeps the documented order (built-ins,
        # then the order of `plugins:`) among implementations without tryfirst/trylast.
        for info in reversed(self.plugins):
            _check_hook_names(info)
            try:
                self.pm.register(self._guarded(info), name=info.name)
            except pluggy.PluginValidationError as err:
                raise ConfigError([("plugins", f"plugin '{info.name}' does not match the hook specs: {err}")])
        for info in self.plugins:
            info.hooks = sorted(c.name for c in self.pm.get_hookcallers(self.pm.get_plugin(info.name)) or [])
            wrapped = [h for h in info.hooks if h in CHAINED and any(
                i.plugin_name == info.name and (i.wrapper or i.hookwrapper) for i in self._caller(h).get_hookimpls())]
            if wrapped:
                raise ConfigError([(f"plugins.{info.name}", f"{', '.join(wrapped)} is chained (each plugin gets the "
                                                            "previous one's result): a hook wrapper cannot wrap it")])
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as err:
            raise ConfigError([("plugins", f"{err} (hook names must be one of those in hfsdp.hooks.specs)")])

    def _guarded(self, info: PluginInfo) -> SimpleNamespace:
        """What pluggy registers for a plugin: its hook implementations, each behind a guard that resolves
        :class:`Lazy` arguments, records the result for :meth:`call` and turns a crash into a PluginError naming
        the plugin and hook (a UserError stays the user's to fix: exit 2)."""
        host, plugin = self, info.name

        def guard(hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.isgeneratorfunction(fn):  # a hook wrapper: errors of the implementations it wraps pass on
                @functools.wraps(fn)
                def wrapper(*args: Any) -> Any:
                    try:
                        return (yield from fn(*[Lazy.resolve(a) for a in args]))
                    except _PASSED_THROUGH:
                        raise
                    except Exception as err:
                        raise PluginError(plugin, hook, err) from err
                return wrapper

            @functools.wraps(fn)
            def implementation(*args: Any) -> Any:
                try:
                    result = fn(*[Lazy.resolve(a) for a in args])
                except _PASSED_THROUGH:
                    raise
                except Exception as err:
                    raise PluginError(plugin, hook, err) from err
                if result is not None and host._recording:
                    host._recording[-1].append((plugin, result))
                return result
            return implementation

        hooks = {name: guard(name, value) for name, value in vars(info.module).items()
                 if name in _HOOK_NAMES and hasattr(value, "hfsdp_impl")}
        return SimpleNamespace(**hooks)

    def _caller(self, hook: str) -> pluggy.HookCaller:
        return getattr(self.pm.hook, hook)

    def _in_order(self, hook: str) -> list[pluggy.HookImpl]:
        """The implementations of ``hook`` in the order pluggy calls them, for the hooks whose caller decides after
        each result (chained, first truthy result, per-plugin problems): call each with :func:`_run`."""
        return list(reversed(self._caller(hook).get_hookimpls()))

    def implementers(self, hook: str) -> list[str]:
        """The plugins implementing ``hook``, in the order pluggy calls them."""
        return [impl.plugin_name for impl in self._in_order(hook)]

    def call(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call ``hook`` through pluggy; ``(plugin, result)`` of every implementation that returned something, in
        the order they ran (a ``firstresult`` spec stops at the first)."""
        self._recording.append([])
        try:
            self._caller(hook)(**kwargs)
        finally:
            results = self._recording.pop()
        return results

    def chain(self, hook: str, value_arg: str, value: Any, **kwargs: Any) -> Any:
        """Pass ``value`` through every implementation of a chained hook, in pluggy's order; a None result keeps
        the value."""
        assert hook in CHAINED, hook
        for impl in self._in_order(hook):
            result = _run(impl, {value_arg: value, **kwargs})
            if result is not None:
                value = result
        return value

    # Typed helpers for the hooks whose results need merging.

    def config_sections(self) -> dict[str, tuple[str, type]]:
        """Section name → (plugin, pydantic model class) of the enabled plugins (asked once)."""
        from pydantic import BaseModel

        if self._sections is not None:
            return self._sections
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
        self._sections = sections
        return sections

    def section_of(self, plugin: str, config: Any) -> Any:
        """The validated config section of ``plugin`` (None when it declares none)."""
        names = [name for name, (owner, _) in self.config_sections().items() if owner == plugin]
        return config.section(names[0]) if names else None

    def validation_problems(self, config: Any) -> list[tuple[str, str]]:
        """Every enabled plugin's ``hfsdp_validate_config`` problems; a plugin whose check reads a section that
        failed validation is skipped (that section's problems are reported already)."""
        problems: list[tuple[str, str]] = []
        for impl in self._in_order("hfsdp_validate_config"):
            try:
                problems += _run(impl, {"config": config}) or []
            except InvalidSectionRead:
                continue
            except ConfigError as err:
                problems += err.problems
        return problems

    def registry(self, hook: str, key: str, named: str, verb: str,
                 same: Callable[[Any], Any] = lambda name: name) -> dict[str, tuple[str, Any]]:
        """Name -> (plugin, value) of what the enabled plugins register through ``hook`` (each returns a dict); a
        name two plugins register (compared as ``same`` makes them) is a ConfigError at ``key``: "{named} '{name}'
        is {verb} by two plugins", unless both register the same object (grpo's and rloo's built-in rewards)."""
        found: dict[str, tuple[str, Any]] = {}
        seen: dict[Any, str] = {}
        for plugin, registered in self.call(hook):
            for name, value in registered.items():
                if same(name) in seen and found[seen[same(name)]][1] is value:
                    continue
                if same(name) in seen:
                    first = seen[same(name)]
                    raise ConfigError([(key, f"{named} '{name}' is {verb} by two plugins: '{found[first][0]}' and "
                                             f"'{plugin}'; disable one of them")])
                seen[same(name)] = name
                found[name] = (plugin, value)
        return found

    def dataset_formats(self) -> dict[str, tuple[str, Callable[..., Any]]]:
        return self.registry("hfsdp_dataset_formats", "data.format", "format", "registered")

    def trains_adapters(self, config: Any) -> bool:
        """An enabled plugin trains adapters on a frozen base (hook ``hfsdp_trains_adapters``)."""
        return any(result for _, result in self.call("hfsdp_trains_adapters", config=config))

    def objective_formats(self) -> dict[str, tuple[str, str]]:
        """Format name -> (plugin, refusal) of the formats only an objective trains on (hook
        ``hfsdp_objective_formats``)."""
        return self.registry("hfsdp_objective_formats", "data.format", "format", "declared for objectives")

    def generation_prompts(self) -> dict[str, tuple[str, Callable[..., Any]]]:
        """Format name -> (plugin, split) for generation eval (hook ``hfsdp_generation_prompts``)."""
        return self.registry("hfsdp_generation_prompts", "generation_eval", "format", "split for generation eval")

    def tokenize_function(self, config: Any, name: str | None = None) -> tuple[str, Callable[..., Any]]:
        """(plugin, tokenize) of the format ``name`` (default ``data.format``), given its plugin's section if it
        takes ``section``."""
        plugin, fn = self.dataset_formats()[name or config.data.format]
        return plugin, WithSection(fn, self.section_of(plugin, config))

    def data_readers(self, config: Any = None) -> dict[str, tuple[str, Callable[..., Any]]]:
        """File suffix or source prefix → (plugin, read); with ``config``, each read gets its plugin's section."""
        readers = self.registry("hfsdp_data_readers", "data.path", "reader", "registered",
                                same=lambda key: key.lower() if isinstance(key, str) else key)
        for key, (plugin, fn) in readers.items():
            if not isinstance(key, str) or not (key.startswith(".") or key.endswith("://")) or not callable(fn):
                raise ConfigError([(f"plugins.{plugin}", f"hfsdp_data_readers: {key!r}: keys are file suffixes "
                                                         "('.tsv') or source prefixes ('mydb://'), values functions")])
        return {key: (plugin, WithSection(fn, self.section_of(plugin, config)) if config is not None else fn)
                for key, (plugin, fn) in readers.items()}

    def export(self, *, out_dir: Any, destination: Any, config: Any, **kwargs: Any) -> str:
        """``hfsdp_export`` into the staged folder ``out_dir``: implementations are asked in pluggy's order (the
        built-in safetensors export is marked ``trylast``) until one returns a truthy value; then
        ``hfsdp_on_export`` on the written folder, before it is renamed to ``destination``. Main process only.
        Returns the name of the plugin that wrote the export."""
        for impl in self._in_order("hfsdp_export"):
            if _run(impl, {"out_dir": out_dir, "config": config, **kwargs}):
                self.call("hfsdp_on_export", out_dir=Path(out_dir), destination=Path(destination), config=config,
                          written_by=impl.plugin_name, model_config=kwargs["model_config"],
                          tokenizer=kwargs["tokenizer"])
                return impl.plugin_name
        raise UserError("export: no plugin wrote the model (every hfsdp_export implementation returned nothing)")


def _run(impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
    """One (guarded) implementation called with the arguments it takes, as pluggy would call it."""
    return impl.function(*[kwargs[name] for name in impl.argnames])


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


def _installed_answers(hook: str) -> dict[str, Any]:
    """Plugin name -> what its ``hook`` (a hook without arguments) returns, of every installed plugin, enabled or not;
    plugins that fail to import or to answer are left out: this only informs, it never stops a run."""
    answers: dict[str, Any] = {}
    for name, ep in sorted(discover().items()):
        try:
            module = ep.load()
            ask = getattr(module, hook, None)
            answer = ask() if callable(ask) and hasattr(ask, "hfsdp_impl") else None
        except Exception:  # noqa: BLE001 (a broken plugin is reported when it is enabled or listed)
            continue
        if answer is not None:
            answers[name] = answer
    return answers


def installed_trainers(format_name: str) -> list[str]:
    """The installed plugins whose objective trains on ``format_name`` (hook ``hfsdp_trains_on``), by name."""
    return [name for name, trains in _installed_answers("hfsdp_trains_on").items() if trains == format_name]


def installed_sections() -> dict[str, tuple[str, type]]:
    """Section name → (plugin, schema) of every installed plugin, enabled or not (for messages and the reference)."""
    sections: dict[str, tuple[str, type]] = {}
    for name, declared in _installed_answers("hfsdp_config_section").items():
        if isinstance(declared, tuple) and len(declared) == 2 and isinstance(declared[0], str):
            sections.setdefault(declared[0], (name, declared[1]))
    return sections
