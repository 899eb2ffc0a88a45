"""Every rule in one table, by phase: what the config alone rules out (``config``), what the data it names needs
(``data``: the files can be read), what the launched world rules out (``world``: its parallel degrees), what a small
trial of the config's values on torch shows (``trial``: the optimizer's arguments), and what the model's architecture
and tokenizer rule out (``model``: the architecture's config, no weights). Each rule is a small function of the
config and the facts of its phase, with the keys it names; :func:`check` runs one phase's rules and returns every
problem at once, :func:`enforce` runs phases in order before anything loads and stops at the first that finds one.

The same table answers everywhere: ``hfsdp validate`` runs ``config`` and ``data`` (and ``trial`` with its rows),
``hfsdp train`` every phase before it decides the run (:func:`hfsdp.setup.decide.decide`), ``hfsdp plan`` ``world``
and ``model`` for each row it predicts, ``hfsdp export`` ``config`` and ``model`` for the checkpoint's model.
Plugins add rules through the ``hfsdp_rules`` hook, as the built-in plugins do (a plugin's older
``hfsdp_validate_config`` is a ``config`` rule too). The rule modules never import torch; the ``trial`` phase imports
it when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from hfsdp.config.data_paths import data_path_problems
from hfsdp.config.files import resolve_config_path, validated_config
from hfsdp.disk.checkpoints import resumes_saved_by_fsdp
from hfsdp.errors import ConfigError, InvalidSectionRead
from hfsdp.hooks.host import Lazy
from hfsdp.rules import (attention, checkpoints, experts, formats, models, optimizers, parallel, quantization, vision,
                         wrapping)

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.hooks.host import PluginHost
    from hfsdp.layout.degrees import World

Phase = Literal["config", "data", "world", "trial", "model"]
PHASES: tuple[Phase, ...] = ("config", "data", "world", "trial", "model")
Problem = tuple[str, str]  # (the config key, what is wrong and how to fix it)


class Facts:
    """What a phase knows besides the config: the enabled plugins (every phase), the launched world with its parallel
    degrees (``world``, ``model``), the architecture's config and the tokenizer (``model``). ``model_config`` and
    ``tokenizer`` may be given as :class:`hfsdp.hooks.host.Lazy`: made the first time a rule reads them (a built-in
    model's files are made on first use), never for a config that an earlier phase refused."""

    def __init__(self, plugins: "PluginHost", world: "World | None" = None, model_config: Any = None,
                 tokenizer: Any = None):
        self.plugins = plugins
        self.world = world
        self._model_config = model_config
        self._tokenizer = tokenizer

    @property
    def model_config(self) -> Any:
        return Lazy.resolve(self._model_config)

    @property
    def tokenizer(self) -> Any:
        return Lazy.resolve(self._tokenizer)

    def with_world(self, world: "World") -> "Facts":
        return Facts(self.plugins, world, self._model_config, self._tokenizer)


@dataclass(frozen=True)
class Rule:
    """One rule: its phase, the config keys it names, and the check (config, facts) -> problems."""

    phase: Phase
    keys: tuple[str, ...]
    check: Callable[["HfsdpConfig", Facts], list[Problem]]


# The plugins' older spelling of a config rule (hfsdp_validate_config), checked before their hfsdp_rules.
VALIDATE_CONFIG = Rule("config", ("plugins",), lambda c, f: f.plugins.validation_problems(c))

RULES: tuple[Rule, ...] = (
    # ---- config alone
    Rule("config", ("data.format", "generation_eval"), lambda c, f: formats.problems(c, f.plugins)),
    Rule("config", ("fsdp.mixed_precision.buffer",), lambda c, f: wrapping.buffer_problems(c)),
    Rule("config", ("train.compile",), lambda c, f: wrapping.compile_problems(c)),
    Rule("config", ("train.tiled_mlp", "train.compile"), lambda c, f: wrapping.tiled_mlp_problems(c)),
    Rule("config", ("train.async_save",), lambda c, f: checkpoints.async_save_problems(c)),
    Rule("config", ("model.quantization", "fsdp.version", "fsdp.cpu_ram_efficient_loading"),
         lambda c, f: quantization.problems(c)),
    Rule("config", ("train.optimizer", "train.optimizer_args", "train.lr_scheduler"),
         lambda c, f: optimizers.config_problems(c)),
    Rule("config", ("parallel", "fsdp.sharding_strategy"), lambda c, f: parallel.config_problems(c)),
    Rule("config", ("parallel.tp_size", "parallel.cp_size", "parallel.sp_size"),
         lambda c, f: parallel.objective_problems(c, f.plugins)),
    Rule("config", ("model.quantization",), lambda c, f: quantization.adapter_problems(c, f.plugins.trains_adapters(c))),
    # ---- the data (and the model) the config names
    Rule("data", ("data",), lambda c, f: data_path_problems(c.data, f.plugins.data_readers())),
    Rule("data", ("model.name_or_path",), lambda c, f: models.problems(c)),
    # ---- the launched world and its degrees
    Rule("world", ("parallel", "fsdp.sharding_strategy", "fsdp.hybrid_shard_size"),
         lambda c, f: f.world.dims.problems(c)),
    Rule("world", ("model.attn_implementation",), lambda c, f: attention.attention_problems(c, f.world.on_cpu)),
    Rule("world", ("train.optimizer",), lambda c, f: optimizers.wrapper_problems(c, f.world.dims.wrapper)),
    Rule("world", ("fsdp",), lambda c, f: wrapping.rehearsal_problems(c, f.world.dims) if f.world.on_cpu else []),
    Rule("world", ("train.async_save",), lambda c, f: checkpoints.wrapper_problems(c, f.world.dims)),
    # ---- a trial on torch
    Rule("trial", ("train.optimizer_args",), lambda c, f: optimizers.trial_problems(c)),
    # ---- the architecture
    Rule("model", ("parallel.tp_size", "parallel.sp_size", "parallel.ep_size"),  # (the model's config read only
         # where a group splits it)
         lambda c, f: parallel.model_problems(c, f.model_config)
         if c.parallel.tp_size * c.parallel.sp_size * c.parallel.ep_size > 1 else []),
    Rule("model", ("train.tiled_mlp",),  # (the model's config read only where it is set)
         lambda c, f: wrapping.tiled_mlp_model_problems(c, f.model_config) if c.train.tiled_mlp else []),
    Rule("model", ("model.experts_implementation", "model.router_aux_loss_coef"),  # (read only where one is set)
         lambda c, f: experts.model_problems(c, f.model_config) if experts.sets_expert_keys(c) else []),
    Rule("model", ("model.freeze", "plugins", "parallel", "model.quantization", "fsdp.version",
                   "data.image_max_pixels"),
         vision.model_problems),  # (the model's config read only where the config asks of it)
)


def plugin_rules(plugins: "PluginHost") -> list[Rule]:
    """The rules the enabled plugins add (``hfsdp_rules``), in pluggy's order."""
    out = []
    for plugin, added in plugins.call("hfsdp_rules"):
        if not isinstance(added, list) or not all(isinstance(rule, Rule) and rule.phase in PHASES for rule in added):
            raise ConfigError([(f"plugins.{plugin}", "hfsdp_rules must return a list of hfsdp.rules.table.Rule (phase "
                                                     f"{', '.join(PHASES)}) or None, got {added!r}")])
        out += added
    return out


def rules(phase: Phase, plugins: "PluginHost") -> list[Rule]:
    """The rules of ``phase``: the enabled plugins' own (``hfsdp_validate_config`` first, then ``hfsdp_rules``),
    then the core's."""
    assert phase in PHASES, phase
    own = [VALIDATE_CONFIG, *plugin_rules(plugins)]
    return [r for r in own if r.phase == phase] + [r for r in RULES if r.phase == phase]


def check(phase: Phase, config: "HfsdpConfig", facts: Facts) -> list[Problem]:
    """Every problem the rules of ``phase`` find, in the table's order. A rule that reads a section which failed
    validation is skipped: that section's own problems are reported already. A rule may raise ConfigError: its
    problems join the others."""
    problems: list[Problem] = []
    for rule in rules(phase, facts.plugins):
        try:
            problems += rule.check(config, facts)
        except InvalidSectionRead:
            continue
        except ConfigError as err:
            problems += err.problems
    return problems


# The phases checked together, in order: the config alone and its data (one report), then the world, the trial and
# the model, each only once the ones before found nothing (their facts cost more: a model's config, torch).
_STAGES: tuple[tuple[Phase, ...], ...] = (("config", "data"), ("world",), ("trial",), ("model",))


def enforce(config: "HfsdpConfig", facts: Facts, phases: tuple[Phase, ...], source: str = "config",
            resume: str | None = None, found: list[Problem] = (), overrides: list[str] = ()) -> Facts:
    """Check ``phases`` of ``config`` in the table's stages (see :data:`_STAGES`), raising ConfigError with every
    problem of the first stage that finds one, each tied to its key in ``source``; ``found``: the problems its schemas
    found (:func:`hfsdp.config.files.validated_config`), reported with the first stage's; a problem of a key given
    with ``overrides`` (``--set``) is blamed on it (:meth:`hfsdp.errors.ConfigError.blamed_on`). Once the config alone
    passed, the world's degrees are derived (:meth:`hfsdp.layout.degrees.World.with_dims`), for a run that resumes
    from ``resume`` ("latest", a checkpoint folder, or None: one process keeps FSDP for a checkpoint FSDP saved); the
    facts are returned with them."""
    problems = list(found)
    for stage in _STAGES:
        wanted = [phase for phase in stage if phase in phases]
        if "world" in wanted and facts.world is not None:
            kept = resumes_saved_by_fsdp(Path(config.train.output_dir), resume)
            facts = facts.with_world(facts.world.with_dims(config, resumes_fsdp=kept))
        if problems := problems + [problem for phase in wanted for problem in check(phase, config, facts)]:
            raise ConfigError(problems, source=source).blamed_on(list(overrides))
    return facts


def load_checked(name_or_path: str | None, overrides: list[str] = (), *,
                 check_data: bool = True) -> tuple["HfsdpConfig", "PluginHost"]:
    """A config file read and validated (:func:`hfsdp.config.files.validated_config`) and checked by the rules of the
    config alone and, with ``check_data``, of the data it names (off for ``hfsdp export``, which reads no data):
    what ``hfsdp validate``, ``plan``, ``bench`` and ``export`` start from."""
    config, host, found = validated_config(name_or_path, overrides)
    enforce(config, Facts(host), ("config", "data") if check_data else ("config",),
            source=str(resolve_config_path(name_or_path)), found=found, overrides=overrides)
    return config, host
