"""Every rule in one table, by phase: what the config alone rules out (``config``), what the data it names needs
(``data``: the files can be read), what the launched world rules out (``world``), and what the model's architecture
rules out (``model``: its config, no weights). Each rule is a small function of the config and the facts of its
phase, with the keys it names; :func:`check` runs one phase's rules and returns every problem at once.

The same table answers everywhere: ``hfsdp validate`` and every command that reads a config run ``config`` (and
``data``), :func:`hfsdp.setup.decide.decide` runs ``world`` before anything loads, ``train`` runs ``model`` once the
architecture's config is read, and ``hfsdp plan`` runs ``world`` and ``model`` for each row it predicts. Plugins add
rules to it through the ``hfsdp_rules`` hook (their ``hfsdp_validate_config`` is a ``config`` rule too). Rules never
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from hfsdp.config.data_paths import data_path_problems
from hfsdp.errors import ConfigError, InvalidSectionRead
from hfsdp.rules import attention, checkpoints, formats, models, optimizers, parallel, quantization, wrapping
from hfsdp.setup import degrees

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.hooks.host import PluginHost
    from hfsdp.setup.degrees import World

Phase = Literal["config", "data", "world", "model"]
PHASES: tuple[Phase, ...] = ("config", "data", "world", "model")
Problem = tuple[str, str]  # (the config key, what is wrong and how to fix it)


@dataclass(frozen=True)
class Facts:
    """What a phase knows besides the config: the enabled plugins (every phase), the launched world with its degrees
    (``world``, ``model``), the architecture's config (``model``)."""

    plugins: "PluginHost"
    world: "World | None" = None
    model_config: Any = None


@dataclass(frozen=True)
class Rule:
    """One rule: its phase, the config keys it names, and the check (config, facts) -> problems."""

    phase: Phase
    keys: tuple[str, ...]
    check: Callable[["HfsdpConfig", Facts], list[Problem]]


RULES: tuple[Rule, ...] = (
    # ---- config alone
    Rule("config", ("plugins",), lambda c, f: f.plugins.validation_problems(c)),  # each plugin's own checks
    Rule("config", ("data.format", "generation_eval"), lambda c, f: formats.problems(c, f.plugins)),
    Rule("config", ("fsdp.mixed_precision.buffer",), lambda c, f: wrapping.buffer_problems(c)),
    Rule("config", ("train.compile",), lambda c, f: wrapping.compile_problems(c)),
    Rule("config", ("train.async_save",), lambda c, f: checkpoints.async_save_problems(c)),
    Rule("config", ("model.quantization", "fsdp.version", "fsdp.cpu_ram_efficient_loading"),
         lambda c, f: quantization.problems(c)),
    Rule("config", ("train.optimizer", "train.optimizer_args", "train.lr_scheduler"),
         lambda c, f: optimizers.config_problems(c)),
    Rule("config", ("parallel",), lambda c, f: parallel.config_problems(c)),
    Rule("config", ("parallel.tp_size", "parallel.sp_size"), lambda c, f: parallel.objective_problems(c, f.plugins)),
    Rule("config", ("model.quantization",), lambda c, f: quantization.adapter_problems(c, f.plugins.trains_adapters(c))),
    # ---- the data (and the model) the config names
    Rule("data", ("data",), lambda c, f: data_path_problems(c.data, f.plugins.data_readers())),
    Rule("data", ("model.name_or_path",), lambda c, f: models.problems(c)),
    # ---- the launched world
    Rule("world", ("fsdp.sharding_strategy", "fsdp.hybrid_shard_size", "parallel"),
         lambda c, f: degrees.problems(c, f.world.size, f.world.local_size)),
    Rule("world", ("model.attn_implementation",), lambda c, f: attention.attention_problems(c, f.world.on_cpu)),
    Rule("world", ("train.optimizer",),
         lambda c, f: optimizers.wrapper_problems(c, wrapping.wrapper(c.fsdp, f.world.size))),
    Rule("world", ("fsdp",), lambda c, f: wrapping.rehearsal_problems(c) if f.world.on_cpu else []),
    Rule("world", ("train.async_save",), lambda c, f: checkpoints.single_process_problems(c, f.world.size)),
    # ---- the architecture
    Rule("model", ("parallel.tp_size", "parallel.sp_size"), lambda c, f: parallel.model_problems(c, f.model_config)),
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
    """The rules of ``phase``: the built-in ones, then the enabled plugins' (``hfsdp_rules``)."""
    assert phase in PHASES, phase
    return [r for r in RULES if r.phase == phase] + [r for r in plugin_rules(plugins) if r.phase == phase]


def check(phase: Phase, config: "HfsdpConfig", facts: Facts) -> list[Problem]:
    """Every problem the rules of ``phase`` find, in the table's order. A rule that reads a section which failed
    validation is skipped: that section's own problems are reported already."""
    problems: list[Problem] = []
    for rule in rules(phase, facts.plugins):
        try:
            problems += rule.check(config, facts)
        except InvalidSectionRead:
            continue
    return problems
