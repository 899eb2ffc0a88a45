"""``hfsdp plan``: predict memory per rank for a config under several sharding strategies and world sizes, before
anything is launched and without loading weights.

Three steps, each a function of the previous one's result:

1. :func:`model_facts`: the model is built on the meta device from its config and changed by the enabled plugins'
   ``hfsdp_modify_model``, as training changes it (LoRA's adapters, on the meta device too). What is kept: every
   parameter's shape, dtype, trainability and the FSDP unit it lands in (the wrap policy, emulated).
2. :func:`trace_activations`: one forward and the training loss of a micro-batch on the meta device (a plugin's
   objective: the sequences it forwards per row, e.g. DPO's chosen and rejected, and its full logits), with a
   saved-tensors hook that records every tensor autograd keeps for the backward pass, tagged by the decoder layer
   that saved it. SDPA is traced as the fused kernels GPUs and CPUs run (they keep q, k, v, the output and the
   log-sum-exp, never the attention matrix); eager attention is traced as it is.
3. :func:`estimate`: arithmetic over those facts for one strategy and world size (no torch needed): how FSDP1
   (flat parameters per unit, padded to the world size) and FSDP2 (each parameter split on dim 0) shard, which
   units are gathered at once, what activation checkpointing keeps, where CPU offload puts things.

The model of a step's peak (per rank, device memory) is documented on :func:`estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hfsdp.config.files import with_plugins
from hfsdp.config.schema import FSDPConfig, HfsdpConfig
from hfsdp.errors import ConfigError
from hfsdp.rules.table import Facts, check
from hfsdp.layout.degrees import World
from hfsdp.tools.plan.estimate import (LONGEST_ROW_LIMIT, Estimate, Generation, Setup, compute_dtype, estimate,
                                       setup_from_config)
from hfsdp.tools.plan.facts import FrozenFacts, ModelFacts, frozen_facts, model_facts
from hfsdp.tools.plan.trace import MicroBatchShape, micro_batch_shape, trace_activations
from hfsdp.units import GIB


# ---- 1. the model on the meta device


# ---- 2. activations, traced on the meta device


# ---- 3. arithmetic


# ---- the plan: rows, fits, and the cheapest change that fits


@dataclass
class Planner:
    """Estimates for variations of one config; facts and traces are computed once per variation that needs them."""

    model_config: Any
    config: HfsdpConfig
    budget: int
    cache_dir: Any = None  # where built-in models are (a frozen model an objective names may be one)
    image_tokens: int | None = None  # a vision-language model's image tokens a row (None: :meth:`image_tokens_per_row`)
    _variants: dict = field(default_factory=dict)
    _objectives: dict = field(default_factory=dict)
    _frozen: dict = field(default_factory=dict)
    _facts: dict = field(default_factory=dict)
    _traces: dict = field(default_factory=dict)

    def variant(self, plugins: tuple[str, ...]):
        """The config with ``plugins`` enabled (its own, or with a suggested plugin added, validated again:
        ConfigError) and their plugin host."""
        if plugins not in self._variants:
            from hfsdp.hooks.host import PluginHost

            try:
                self._variants[plugins] = ((self.config, PluginHost(self.config.plugins))
                                           if list(plugins) == self.config.plugins else
                                           with_plugins(self.config, list(plugins)))
            except ConfigError as err:
                self._variants[plugins] = err
        if isinstance(self._variants[plugins], ConfigError):
            raise self._variants[plugins]
        return self._variants[plugins]

    def objective(self, plugins: tuple[str, ...]):
        """The objective these plugins train (``hfsdp_objective``, asked without a tokenizer), or None: the default."""
        from hfsdp.objective import objective_of

        if plugins not in self._objectives:
            config, host = self.variant(plugins)
            self._objectives[plugins] = objective_of(host, config, None, self.cache_dir)
        return self._objectives[plugins]

    def frozen(self, plugins: tuple[str, ...]) -> tuple[FrozenFacts, ...]:
        """The frozen models these plugins' objective runs beside the trained one (a distillation teacher)."""
        if plugins not in self._frozen:
            objective = self.objective(plugins)
            self._frozen[plugins] = tuple(frozen_facts(m) for m in (objective.frozen_models() if objective else []))
        return self._frozen[plugins]

    def generation(self, plugins: tuple[str, ...]) -> Generation | None:
        """What these plugins' objective samples each step (GRPO's completions), or None."""
        objective = self.objective(plugins)
        sampling = objective.sampling() if objective is not None else None
        if sampling is None:
            return None
        config, _ = self.variant(plugins)
        return Generation(config.train.per_device_batch_size, config.data.max_seq_len, sampling.new_tokens,
                          sampling.whole_global_batch)

    def shape(self, plugins: tuple[str, ...]) -> MicroBatchShape:
        """The micro-batch traced with these plugins (:func:`micro_batch_shape`)."""
        config, host = self.variant(plugins)
        return micro_batch_shape(config, host, self.objective(plugins))

    def facts(self, plugins: tuple[str, ...]) -> ModelFacts:
        if plugins not in self._facts:
            self._facts[plugins] = model_facts(self.model_config, *self.variant(plugins))
        return self._facts[plugins]

    def estimate(self, setup: Setup) -> Estimate:
        facts = self.facts(setup.plugins)
        acts = self.activations(setup)
        est = estimate(facts, acts, setup, self.frozen(setup.plugins), self.generation(setup.plugins))
        est.problem = self.problem(setup)
        if est.problem is None:
            est.fits = est.device_peak <= self.budget
        return est

    def image_tokens_per_row(self) -> int | None:
        """The image tokens a row of a vision-language model carries, whose images the vision tower runs on: those
        given (``hfsdp plan --image-tokens``), else as many as a row holds (``data.max_seq_len``: the most a row's
        images can make, however many there are); None for a text-only model."""
        from hfsdp.rules.vision import is_vision_language

        if not is_vision_language(self.model_config):
            return None
        return self.config.data.max_seq_len if self.image_tokens is None else self.image_tokens

    def activations(self, setup: Setup):
        """The traced activations of ``setup``'s micro-batch (a sequence-parallel rank's share with ``sp > 1``)."""
        key = (setup.plugins, compute_dtype(self.config, setup.precision), setup.dims.token_split)
        if key not in self._traces:
            self._traces[key] = trace_activations(self.model_config, *self.variant(setup.plugins), setup.precision,
                                                  self.objective(setup.plugins), setup.dims.token_split,
                                                  self.image_tokens_per_row() or 0)
        return self._traces[key]

    def longest_row(self, setup: Setup) -> int | None:
        """The most tokens a row of ``setup``'s micro-batch may have (``data.max_seq_len``, or a packed row's) for
        the peak to stay within the device budget, the micro-batch's other dimensions kept; 0 where not even a
        token fits; :data:`LONGEST_ROW_LIMIT` where that many fit. The traced activations are scaled to each length
        (:meth:`Activations.scaled`); None where that does not hold (eager attention, whose scores grow with the
        square of a row) or the objective samples its rows."""
        if self.config.model.attn_implementation == "eager" or self.generation(setup.plugins) is not None:
            return None
        facts, frozen, acts = self.facts(setup.plugins), self.frozen(setup.plugins), self.activations(setup)
        traced = self.shape(setup.plugins).width  # the whole row's positions (a rank's: 1/sp of them)
        local = -(-traced // setup.dims.token_split)

        def fits(tokens: int) -> bool:
            scaled = acts.scaled(-(-tokens // setup.dims.token_split) / local)
            return estimate(facts, scaled, setup, frozen, None).device_peak <= self.budget

        if fits(LONGEST_ROW_LIMIT):
            return LONGEST_ROW_LIMIT
        low, high = 0, 1
        while fits(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def problem(self, setup: Setup) -> str | None:
        """Why this combination cannot run at all, by the checks training makes before any weight loads: the
        ``fsdp`` section's own rules, then the rule table's ``config``, ``world`` and ``model`` phases for this
        world, and the enabled plugins' ``hfsdp_before_model_load`` (e.g. LoRA's FSDP1 single-shard refusal)."""
        from hfsdp.setup.decide import RunSetup

        try:
            FSDPConfig.model_validate(setup.fsdp.model_dump())
        except ValueError as err:
            return "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        config, host = self.variant(setup.plugins)
        train = config.train.model_copy(update={"optimizer": setup.optimizer})
        planned = config.model_copy(update={"train": train, "fsdp": setup.fsdp, "parallel": setup.parallel})
        world = World(rank=0, size=setup.world, local_size=setup.nproc_per_node, on_cpu=False).with_dims(planned)
        facts = Facts(plugins=host, world=world, model_config=self.model_config)
        problems = check("config", planned, facts) + check("world", planned, facts) + check("model", planned, facts)
        if not problems:
            try:
                host.call("hfsdp_before_model_load", config=planned, world=world, model_config=self.model_config,
                          setup=RunSetup(config=planned, world=world, resume=None))
            except ConfigError as err:
                problems = err.problems
        return f"{problems[0][0]}: {problems[0][1]}" if problems else None

    def suggest(self, setup: Setup, more_ranks: list[int]) -> str | None:
        """The cheapest set of changes that makes ``setup`` fit, written as the ``--set`` (and ``--nproc``) it
        takes and checked by the same estimate. The changes, cheapest first: those that keep the hardware and the
        training maths (FULL_SHARD, activation checkpointing, sampling with a layer gathered at a time), then
        precision (bf16), AdamW's moments in 8 bits
        (``train.optimizer=adamw_8bit``: 2 bytes a parameter instead of 8, plus its block scales), more ranks per
        node (fewer first), LoRA, CPU offload (slowest). Sets are tried in order of cost (:func:`change_sets`): the
        costliest change a set needs, then how many changes it makes, so a change that fits alone is never printed
        with others it does not need."""
        changes: list[Change] = []
        if setup.strategy != "FULL_SHARD":
            changes.append(Change("fsdp.sharding_strategy=FULL_SHARD", fsdp={"sharding_strategy": "FULL_SHARD"}))
        if not setup.fsdp.activation_checkpointing:
            changes.append(Change("fsdp.activation_checkpointing=true", fsdp={"activation_checkpointing": True}))
        if (setup.wrapper == "fsdp2" and setup.fsdp.gather_for_generation
                and self.generation(setup.plugins) is not None):  # sampling: a layer at a time instead of the model
            changes.append(Change("fsdp.gather_for_generation=false", fsdp={"gather_for_generation": False}))
        if setup.precision == "no":
            changes.append(Change("fsdp.mixed_precision=bf16", fsdp={"mixed_precision": "bf16"}))
        if setup.optimizer == "adamw" and not setup.optimizer_args:  # its arguments are AdamW's, not AdamW8bit's
            changes.append(Change("train.optimizer=adamw_8bit", job={"optimizer": "adamw_8bit"}))
        for n in sorted(set(more_ranks)):
            if n > setup.nproc_per_node:
                changes.append(Change(f"--nproc {n} ({n * setup.nodes} ranks)", job={"nproc_per_node": n},
                                      group="nproc"))
        facts = self.facts(setup.plugins)
        if facts.trainable_params == facts.total_params:  # no plugin trains adapters (or freezes layers) yet
            plugins = (*setup.plugins, "lora")
            changes.append(Change(f"plugins=[{','.join(plugins)}]", job={"plugins": plugins}))
        if not setup.fsdp.cpu_offload:
            changes.append(Change("fsdp.cpu_offload=true", fsdp={"cpu_offload": True}))
        for chosen in change_sets(changes):
            fsdp = {k: v for c in chosen for k, v in c.fsdp.items()}
            job = {k: v for c in chosen for k, v in c.job.items()}
            try:
                candidate = setup.changed(fsdp=fsdp, **job)
                est = self.estimate(candidate)
            except (ValueError, ConfigError):  # e.g. cpu_offload with NO_SHARD under FSDP2; lora's config checks
                continue
            if est.problem is None and est.fits:
                # Launch options first (as they are typed), then --set keys.
                words = sorted((c.words for c in chosen), key=lambda w: not w.startswith(("--", "plugins")))
                return f"{' '.join(words)} -> {est.device_peak / GIB:.1f} GiB"
        return None


@dataclass(frozen=True)
class Change:
    """One change ``Planner.suggest`` may propose: its words in the table, the ``fsdp`` keys and job fields it sets,
    and a group of alternatives of which one set holds at most one (the rank counts)."""

    words: str
    fsdp: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    group: str | None = None


def change_sets(changes: list[Change]):
    """Every non-empty set of ``changes`` (at most one of each group), in order of cost: ``changes`` is ordered
    cheapest first, and a set costs first its costliest change, then its number of changes, then the costs of its
    other changes (cheaper first)."""
    import itertools

    sets = []
    for size in range(1, len(changes) + 1):
        for combo in itertools.combinations(range(len(changes)), size):
            groups = [changes[i].group for i in combo if changes[i].group]
            if len(groups) == len(set(groups)):
                sets.append(combo)
    sets.sort(key=lambda combo: (combo[-1], len(combo), combo))
    return ([changes[i] for i in combo] for combo in sets)


def plan(planner: Planner, strategies: list[str], nprocs: list[int], nodes: int,
         tps: list[int] | None = None, sps: list[int] | None = None, eps: list[int] | None = None,
         cps: list[int] | None = None) -> list[Estimate]:
    """One estimate per world size x tensor-parallel size (``tps``, default: the config's) x context-parallel size
    (``cps``) x sequence-parallel size (``sps``; each default: the config's; either given, each row also says the
    longest row that fits, :meth:`Planner.longest_row`) x expert-parallel size (``eps``, default: the config's) x
    strategy; rows that do not fit carry the cheapest change that would."""
    rows = []
    parallel = planner.config.parallel
    for nproc, tp, cp, sp, ep, strategy in ((n, t, c, q, e, s) for n in nprocs for t in tps or [parallel.tp_size]
                                            for c in cps or [parallel.cp_size] for q in sps or [parallel.sp_size]
                                            for e in eps or [parallel.ep_size] for s in strategies):
        setup = setup_from_config(planner.config, strategy, nproc, nodes, tp, sp, ep, cp)
        est = planner.estimate(setup)
        if (sps is not None or cps is not None) and est.problem is None:
            est.longest_row = planner.longest_row(setup)
        if est.fits is False:
            # More ranks: the larger listed sizes, then twice and four times the largest.
            est.suggestion = planner.suggest(setup, [n for n in nprocs if n > nproc] + [2 * max(nprocs),
                                                                                       4 * max(nprocs)])
        rows.append(est)
    return rows


