"""Step 3 of ``hfsdp plan``: the bytes per rank of one setup (strategy, world, plugins, optimizer), arithmetic over
hand-buildable facts (:class:`~hfsdp.tools.plan.facts.ModelFacts`, :class:`~hfsdp.tools.plan.facts.Activations`):
no torch. How FSDP1 (flat parameters per unit, padded to the world size) and FSDP2 (each parameter split on dim 0)
shard, which units are gathered at once, what activation checkpointing keeps, where CPU offload puts things; the
model of a step's peak is documented on :func:`estimate`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from hfsdp.config.schema import FSDPConfig, HfsdpConfig, ParallelConfig
from hfsdp.layout.degrees import FSDP_WRAPPERS, ParallelDims, Wrapper
from hfsdp.rules.wrapping import precision_parts
from hfsdp.tools.plan.facts import Activations, FrozenFacts, ModelFacts, Param, _chunk, _gathered_itemsize
from hfsdp.units import DTYPE_BYTES, PRECISION_DTYPES


# FSDP1 with use_orig_params pads each original parameter inside its flat parameter to a 16-byte boundary.
_FSDP1_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Setup:
    """One table row's knobs: the config's ``fsdp`` and ``parallel`` sections (varied by strategy, by the planned
    degrees and by suggested changes) and the job's shape."""

    fsdp: FSDPConfig
    nproc_per_node: int
    nodes: int
    plugins: tuple[str, ...]  # enabled, in order (varied when a plugin is suggested)
    accumulation: int
    multi_tensor_adam: bool = True  # torch's AdamW on GPUs; on CPUs it loops over parameters
    async_save: bool = False  # train.async_save: a host-memory copy of the rank's state while a save is in flight
    optimizer: str = "adamw"  # train.optimizer, and its train.optimizer_args
    optimizer_args: tuple[tuple[str, Any], ...] = ()
    # the degrees (tp: FSDP2 shards over world / tp; sp: each rank traces 1/sp of a row's tokens)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def changed(self, fsdp: dict[str, Any] | None = None, **job: Any) -> "Setup":
        """This setup with some ``fsdp`` keys and job fields changed; the section is validated again (ValueError)."""
        section = FSDPConfig.model_validate({**self.fsdp.model_dump(), **(fsdp or {})}) if fsdp else self.fsdp
        return replace(self, fsdp=section, **job)

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nodes

    @property
    def strategy(self) -> str:
        return self.fsdp.sharding_strategy

    @property
    def precision(self) -> str:
        return self.fsdp.precision_name

    @property
    def wrapper(self) -> Wrapper:
        """What wraps the model, by train's own rule (the degrees': :meth:`ParallelDims.of`): ``none`` is one process
        training the model as it is (full parameters, gradients and optimizer state, no FSDP buffers)."""
        return self.dims.wrapper

    @property
    def runs_as(self) -> str:
        """What wraps the model, for the table: FSDP, DDP or nothing."""
        return {"none": "no wrapper", "ddp": "DDP"}.get(self.wrapper, "FSDP")

    @property
    def prefetch(self) -> int:
        """Layer units gathered ahead of the one computing: FSDP1 backward_prefetch (default BACKWARD_PRE), FSDP2's
        implicit prefetch of the next unit."""
        return 0 if self.fsdp.version == 1 and self.fsdp.backward_prefetch == "NONE" else 1

    @property
    def dims(self) -> ParallelDims:
        """The degrees this setup runs with, by train's own rule (:meth:`hfsdp.layout.degrees.ParallelDims.of`)."""
        return ParallelDims.of(self.fsdp, self.parallel, self.world, self.nproc_per_node)


def setup_from_config(config: HfsdpConfig, strategy: str, nproc_per_node: int, nodes: int,
                      tp: int | None = None, sp: int | None = None, ep: int | None = None,
                      cp: int | None = None) -> Setup:
    """A row's setup: ``tp``, ``sp``, ``ep`` and ``cp`` (default: the config's ``parallel.tp_size``, ``sp_size``,
    ``ep_size`` and ``cp_size``) the tensor-, sequence-, expert- and context-parallel group sizes, the data-parallel
    degrees the rest (a row varies the world)."""
    parallel = config.parallel.model_copy(update={"tp_size": tp or config.parallel.tp_size,
                                                  "sp_size": sp or config.parallel.sp_size,
                                                  "cp_size": cp or config.parallel.cp_size,
                                                  "ep_size": ep or config.parallel.ep_size, "dp_shard_size": -1})
    base = Setup(fsdp=config.fsdp, nproc_per_node=nproc_per_node, nodes=nodes, plugins=tuple(config.plugins),
                 accumulation=config.train.gradient_accumulation_steps, async_save=config.train.async_save,
                 optimizer=config.train.optimizer, optimizer_args=tuple(config.train.optimizer_args.items()),
                 parallel=parallel)
    # Not validated here: a strategy the rest of the section rules out becomes a row saying why (Planner.problem).
    return replace(base, fsdp=config.fsdp.model_copy(update={"sharding_strategy": strategy}))


@dataclass(frozen=True)
class Generation:
    """An objective's sampling at the start of a step (:class:`hfsdp.objective.Sampling`), in the plan's terms:
    ``rows`` completions per micro-batch (``train.per_device_batch_size``) after prompts of at most
    ``prompt_tokens`` (``data.max_seq_len``), each at most ``new_tokens`` long; ``whole_global_batch``: every rank
    generates the global batch's."""

    rows: int
    prompt_tokens: int
    new_tokens: int
    whole_global_batch: bool = True


# The longest row ``hfsdp plan --sp`` looks for (:meth:`hfsdp.tools.plan.planner.Planner.longest_row`): 4M tokens,
# beyond any model's context today.
LONGEST_ROW_LIMIT = 2 ** 22


@dataclass
class Estimate:
    """Bytes per rank (the largest rank's) for one setup."""

    setup: Setup
    params: int
    grads: int
    optimizer: int
    gathered: int  # unsharded parameters FSDP holds at the peak (root unit + prefetched layer units, or all)
    grad_buffers: int  # unsharded gradients and their reduce-scatter copies; DDP's buckets; tied-weight sums
    activations: int
    loss_transient: int
    optimizer_step_temp: int
    device_peak: int
    host_per_rank: int  # CPU offload: parameters, gradients and optimizer state; async saves: their staging copy
    host_load_per_node: int  # host RAM when the model is loaded, before sharding
    fsdp_comm: int = 0  # bytes a rank all-gathers and reduce-scatters (DDP: all-reduces) per optimizer step
    tp_comm: int = 0  # bytes a rank all-reduces inside its tensor-parallel group per optimizer step
    sp_comm: int = 0  # bytes a rank sends in its sequence-parallel group's all-to-alls per optimizer step
    cp_comm: int = 0  # bytes a rank passes to the next rank of its ring (context parallel) per optimizer step
    ep_comm: int = 0  # bytes a rank sends in its expert-parallel group's all-to-alls per optimizer step
    frozen: int = 0  # frozen models an objective runs beside the trained one (a teacher): parameters and logits
    generation: int = 0  # an objective's sampling: gathered parameters, KV cache and transients (not parameters)
    problem: str | None = None
    longest_row: int | None = None  # hfsdp plan --sp: the most tokens a row may have and still fit (Planner.longest_row)
    fits: bool | None = None
    suggestion: str | None = None

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def compute_dtype(config: HfsdpConfig, precision: str) -> str:
    return PRECISION_DTYPES.get(precision, config.model.dtype)


def _fsdp2_bytes(params: tuple[Param, ...], group: int, select: Callable[[Param], bool]) -> int:
    """The largest rank's bytes of the selected parameters, each split on dim 0 across ``group`` ranks (a rank's
    experts under expert parallelism across the ``group / ep`` ranks that hold them)."""
    return max(sum((p.numel if p.replicated else _chunk(p.rows, group // p.ep, r % (group // p.ep))
                    * (p.numel // max(p.rows, 1))) * p.itemsize
                   for p in params if select(p)) for r in range(group))


def _fsdp1_bytes(facts: ModelFacts, group: int, select: Callable[[Param], bool], align: bool,
                 whole_flat: bool) -> int:
    """The largest rank's bytes under FSDP1: each unit's parameters flattened (aligned to 16 bytes with
    use_orig_params), padded to a multiple of ``group`` and split evenly. ``whole_flat`` counts the rank's whole
    flat shard (parameters); otherwise only the selected parameters' views in it (gradients, optimizer state)."""
    per_rank = [0] * group
    for unit in range(len(facts.units)):
        offset, spans = 0, []
        itemsize = 4
        for p in facts.params:
            if p.unit != unit:
                continue
            itemsize = p.itemsize
            if align:
                step = max(1, _FSDP1_ALIGN_BYTES // p.itemsize)
                offset = -(-offset // step) * step
            spans.append((offset, p.numel, p))
            offset += p.numel
        if not spans:
            continue
        shard = -(-offset // group)
        for r in range(group):
            lo, hi = r * shard, (r + 1) * shard
            if whole_flat:
                per_rank[r] += shard * itemsize if any(select(p) for _, _, p in spans) else 0
            else:
                per_rank[r] += sum(max(0, min(hi, o + n) - max(lo, o)) * p.itemsize for o, n, p in spans if select(p))
    return max(per_rank)


def sharded_bytes(facts: ModelFacts, setup: Setup, select: Callable[[Param], bool], whole_flat: bool = False) -> int:
    group = setup.dims.shard_group
    if setup.wrapper in ("ddp", "none"):
        return sum(p.numel * p.itemsize for p in facts.params if select(p))
    if setup.fsdp.version == 1:
        return _fsdp1_bytes(facts, group, select, setup.fsdp.use_orig_params is not False, whole_flat)
    return _fsdp2_bytes(facts.params, group, select)


def optimizer_bytes(facts: ModelFacts, setup: Setup) -> int:
    """The largest rank's bytes of optimizer state (tensors of one or more dimensions, each storage once, as
    bench counts them), as each ``train.optimizer`` allocates it for the trainable parameters: AdamW and
    schedule-free AdamW two parameter-sized tensors (moments; z and the second moment), SGD one with momentum,
    Muon one momentum for its hidden matrices and AdamW's two for the rest, sharded as the gradients are; Adafactor
    a row and a column factor per matrix and a full second moment per vector, under FSDP2 the rows' share of the
    row factors and moments and the whole column factors (:class:`hfsdp.run.sharded.adafactor.ShardedAdafactor`); 8-bit
    AdamW two bytes per element plus two float32 block scales per 256 elements and the two 256-entry quantization
    maps all parameters share, with parameters under ``min_8bit_size`` elements (whole) in float32: under FSDP2
    those of the rank's shard, and whole on every rank for a parameter whose shards do not fall on the 256-element
    blocks (:func:`hfsdp.run.optimizers.blocks_follow_shards`: it runs on the gathered tensor)."""
    from hfsdp.rules.optimizers import BNB_BLOCK, BNB_MIN_8BIT
    from hfsdp.run.optimizers import blocks_follow_shards

    args = dict(setup.optimizer_args)
    trainable = [p for p in facts.params if p.trainable]
    select = lambda hidden: lambda p: p.trainable and p.hidden == hidden  # noqa: E731
    if setup.optimizer == "muon":
        return sharded_bytes(facts, setup, select(True)) + 2 * sharded_bytes(facts, setup, select(False))
    if setup.optimizer == "sgd":
        return sharded_bytes(facts, setup, lambda p: p.trainable) if args.get("momentum", 0) else 0
    if setup.optimizer == "adafactor":
        group = setup.dims.shard_group if setup.wrapper == "fsdp2" else 1

        def factors(p: Param, rank: int) -> int:  # row factors and vector moments sharded as the rows, columns whole
            rows = _chunk(p.rows, group, rank) if group > 1 else p.rows
            if len(p.shape) >= 2:
                return 4 * (rows * (p.numel // p.shape[-1]) // max(p.rows, 1) + p.numel // p.shape[-2])
            return 4 * rows * (p.numel // max(p.rows, 1))

        return max(sum(factors(p, rank) for p in trainable) for rank in range(group))
    if setup.optimizer == "adamw_8bit":
        small = args.get("min_8bit_size", BNB_MIN_8BIT)
        quantized = [p for p in trainable if p.numel >= small]
        group = setup.dims.shard_group if setup.wrapper == "fsdp2" else 1

        def per_rank(p: Param, rank: int) -> int:
            if p.numel < small:
                return 2 * 4 * (_chunk(p.rows, group, rank) * (p.numel // max(p.rows, 1)) if group > 1 else p.numel)
            if group > 1 and blocks_follow_shards(p.shape or (p.rows, p.numel // max(p.rows, 1)), group):
                numel = _chunk(p.rows, group, rank) * (p.numel // max(p.rows, 1))
            else:
                numel = p.numel
            return 2 * numel + 2 * 4 * -(-numel // BNB_BLOCK)

        return (max(sum(per_rank(p, rank) for p in trainable) for rank in range(group))
                + (2 * 256 * 4 if quantized else 0))
    return 2 * sharded_bytes(facts, setup, lambda p: p.trainable)  # adamw, schedule_free_adamw


def frozen_bytes(frozen: tuple[FrozenFacts, ...], acts: Activations, setup: Setup) -> int:
    """The largest rank's bytes of the frozen models an objective runs beside the trained one: their parameters
    (FSDP2 splits each on dim 0 over the world when the run has several ranks and shards with FSDP2; else each
    rank holds them whole) and, for those that keep them, their logits over the micro-batch (the size of the
    trained model's, in their dtype), alive through the trained model's forward and backward."""
    total = 0
    for model in frozen:
        g = setup.world if model.sharded_by_fsdp2 and setup.world > 1 and setup.fsdp.version == 2 else 1
        total += _fsdp2_bytes(model.params, g, lambda p: True)
        if model.keeps_logits:
            total += acts.logits_bytes // 4 * model.itemsize
    return total


def generation_bytes(facts: ModelFacts, acts: Activations, setup: Setup, gen: Generation, compute: int | None,
                     gathered: int) -> int:
    """Bytes beside the parameters and optimizer state while an objective samples its completions (no gradients
    then): the parameters ``generate`` needs gathered (FSDP1 summons the whole model in its own dtype; FSDP2 gathers
    every unit once in the compute dtype with ``fsdp.gather_for_generation``, else unit by unit as a forward does:
    ``gathered``), the KV cache of every sequence generated at once at its
    full length, in the compute dtype, with one layer's grown copy beside it (``DynamicCache`` concatenates), one
    layer's prefill activations (the traced layer's saved tensors scaled to the prefill's tokens: an upper bound,
    as the prefill keeps nothing for backward) and the last positions' float32 logits with the sampler's two
    copies."""
    sequences = gen.rows * setup.accumulation * (setup.dims.dp_size if gen.whole_global_batch else 1)
    itemsize = compute or facts.params[0].itemsize
    if setup.wrapper == "fsdp1" and setup.dims.dp_shard > 1:
        gathered = sum(p.numel * p.itemsize for p in facts.params)  # summon_full_params, beside the shards
        itemsize = facts.params[0].itemsize
    elif setup.wrapper == "fsdp2" and setup.fsdp.gather_for_generation and setup.dims.dp_shard > 1:
        gathered = sum(p.numel for p in facts.params) * itemsize  # every unit gathered once, in the compute dtype
    kv = facts.kv_per_token * sequences * (gen.prompt_tokens + gen.new_tokens) * itemsize
    prefill = max(acts.per_layer, default=0) * sequences * gen.prompt_tokens // max(acts.tokens, 1)
    return gathered + kv + kv // max(facts.num_layers, 1) + prefill + 3 * sequences * facts.vocab_size * 4


def estimate(facts: ModelFacts, acts: Activations, setup: Setup, frozen: tuple[FrozenFacts, ...] = (),
             generation: Generation | None = None) -> Estimate:
    """Per-rank memory of one strategy and world size.

    * one process runs without a wrapper unless ``fsdp.single_process: fsdp`` or an option needs FSDP (as train
      does, ``Setup.wrapper``): the whole parameters, gradients and optimizer state, no gathered units and no
      reduce buffers; with mixed precision, autocast's compute-dtype copy of the weights.
    * parameters / gradients / optimizer: the largest rank's share, sharded as FSDP1/FSDP2 shard (see module
      docstring); gradients and AdamW's two moments only for trainable parameters, in the parameters' dtype.
    * gathered: unsharded parameters in the compute dtype. FULL_SHARD / HYBRID_SHARD: the root unit (FSDP keeps
      it gathered through forward and backward) plus the largest layer unit times (1 + prefetch). SHARD_GRAD_OP:
      every unit stays gathered from its forward to its backward. NO_SHARD: a compute-dtype copy of the model when
      mixed precision casts it, nothing otherwise.
    * grad buffers: the root unit's unsharded gradients (alive from the lm_head's backward to the end) plus the
      largest of: one layer unit's unsharded gradients and their reduce-scatter copy (reduce dtype), the root's
      reduce-scatter copy, the tied embedding's second gradient before it is added to the first. DDP: its buckets
      (a second copy of every gradient) plus the tied embedding's second gradient. With ``train.chunked_loss`` a
      tied embedding has no second gradient: its backward adds its rows into the head's.
    * activations: what autograd saves for one micro-batch (traced), with checkpointing: the layer inputs plus one
      recomputed layer. The loss adds transients: two float32 logits-sized tensors at the end of forward (the
      logits, their reshaped copy, the float32 upcast), one in backward (the logits' gradient), beside the saved
      float32 log-softmax. With ``train.chunked_loss`` nothing logits-sized is saved; at the end of forward it
      makes each chunk's gradients (``hfsdp.model.token_loss.LOSS_CHUNK_ELEMENTS`` logits a chunk), whose peak is
      three chunk-sized tensors, or one beside the head's gradient (:attr:`Activations.loss_forward`), and its
      backward adds nothing.
    * peak = parameters + optimizer + the largest of four moments: the end of forward (gathered + activations +
      loss transients; DDP's buckets too, which it holds from its construction), backward (gathered + the root's
      and one layer's gradient buffers + activations + one logits-sized gradient), the end of backward (gathered
      + the root's buffers + gradients), the optimizer step (gradients + AdamW's temporaries: one state-sized
      tensor on GPUs, where it runs multi-tensor; one parameter's worth on CPUs). With gradient accumulation, the
      earlier micro-batches' gradients are there during forward and backward too.
    * CPU offload moves parameters, gradients and optimizer state to host memory (``host_per_rank``).
    * ``train.async_save`` stages a copy of the rank's parameters and optimizer state in host memory while a save
      is written (one save in flight at a time): added to ``host_per_rank`` where FSDP wraps the model.
    * host RAM at load, per node: every rank reads the full model in ``model.dtype``, or only rank 0 with
      cpu_ram_efficient_loading (FSDP only).
    * ``frozen``: models a plugin's objective runs beside the trained one (a distillation teacher), added to the
      peak as :func:`frozen_bytes` counts them; every rank loads them whole (host RAM at load).
    * ``generation``: an objective that samples its completions (GRPO) adds a fifth moment, the sampling at the
      step's start (:func:`generation_bytes`); the traced micro-batch already has the completions' length.
    """
    full_load = sum(p.numel * p.itemsize for p in facts.params)  # every loading rank reads the whole model
    # a tensor-parallel rank's slices, an expert-parallel rank's experts; FSDP2 shards them over the dp ranks
    facts = facts.tp_local(setup.dims.tp).ep_local(setup.dims.ep)
    everything = lambda p: True  # noqa: E731
    trainable = lambda p: p.trainable  # noqa: E731
    params = sharded_bytes(facts, setup, everything, whole_flat=True) + facts.quant_state_bytes
    grads = sharded_bytes(facts, setup, trainable)
    optimizer = optimizer_bytes(facts, setup)
    compute = DTYPE_BYTES[PRECISION_DTYPES.get(setup.precision, "float32")] if setup.precision != "no" else None
    full_compute = sum(p.numel * _gathered_itemsize(p, compute) for p in facts.params)
    root = facts.unit_bytes(0, compute)
    layer_units = [facts.unit_bytes(u, compute) for u in range(1, len(facts.units))]
    largest = max(layer_units, default=0)
    group = setup.dims.shard_group
    if setup.wrapper in ("none", "ddp") or (setup.fsdp.version == 1 and group == 1):
        gathered = full_compute if compute else 0
    elif setup.strategy == "SHARD_GRAD_OP":
        gathered = full_compute
    else:
        gathered = root + largest * (1 + setup.prefetch)
    parts = precision_parts(setup.fsdp)
    reduce_size = DTYPE_BYTES[parts.reduce] if parts else None

    def unit_grads(unit: int, itemsize: int | None) -> int:
        return sum(p.numel * (itemsize or p.itemsize) for p in facts.params if p.unit == unit and p.trainable)

    # Gradient buffers beside the (sharded) gradients: during backward, and at its end, when the root unit's
    # gradients are complete.
    # the tied weight's second gradient (the input embedding's, head-sized), but where the chunked loss has the
    # embedding add its rows into the head's gradient
    tied_numel = 0 if acts.one_tied_gradient else facts.tied_trainable_numel
    tied_grad = tied_numel * facts.params[0].itemsize
    if setup.wrapper == "none":
        # Autograd alone: the tied weight's second gradient meets the first at the end.
        during, at_end = 0, tied_grad
    elif setup.wrapper == "ddp":
        # DDP's buckets hold a second copy of every gradient, from its construction on (in forward too); the tied
        # weight's two gradients meet at the end.
        buckets = sum(p.numel * p.itemsize for p in facts.params if p.trainable)
        during, at_end = buckets, buckets + tied_grad
    else:
        tied = tied_numel * (compute or facts.params[0].itemsize)
        if group == 1 and setup.fsdp.version == 1:  # FSDP1 reduces a single shard's flat gradient in place
            during, at_end = 0, tied
        else:
            # The root's unsharded gradients live from the lm_head's backward to the end; meanwhile one layer
            # unit's unsharded gradients and their reduce-scatter copy; at the end the root's reduce-scatter copy,
            # or before it the tied weight's second gradient, not yet added to the first.
            root = unit_grads(0, compute)
            layer = max((unit_grads(u, compute) + unit_grads(u, reduce_size) for u in range(1, len(facts.units))),
                        default=0)
            during, at_end = root + layer, root + max(unit_grads(0, reduce_size), tied)
    grad_buffers = max(during, at_end)
    activations = acts.saved(setup.fsdp.activation_checkpointing)
    loss_transient = acts.loss_forward
    # AdamW's multi-tensor path (GPUs) allocates one state-sized temporary (the second moment's square root); the
    # per-parameter loop (CPUs) one parameter's worth.
    step_temp = grads if setup.multi_tensor_adam else max(
        (p.numel * p.itemsize // setup.dims.shard_group for p in facts.params if p.trainable), default=0)
    on_device_params, on_device_grads, on_device_optim = params, grads, optimizer
    host = 0
    if setup.fsdp.cpu_offload:
        host = params + grads + optimizer
        on_device_params = on_device_grads = on_device_optim = step_temp = 0
    if setup.async_save and setup.wrapper in FSDP_WRAPPERS:
        host += params + optimizer
    earlier_grads = on_device_grads if setup.accumulation > 1 else 0
    # The loss: at the end of forward the logits, their reshaped copy and float32 upcast sit beside the saved
    # log-softmax (``loss_transient``); in backward one logits-sized gradient at a time. The chunked loss: its
    # chunks' gradients made at the end of forward (``loss_transient``), nothing in backward.
    persistent = during if setup.wrapper == "ddp" else 0  # DDP's buckets
    forward_end = gathered + persistent + activations + loss_transient + earlier_grads
    backward = gathered + during + activations + acts.loss_backward + earlier_grads
    backward_end = gathered + at_end + on_device_grads
    step = on_device_grads + step_temp
    held = frozen_bytes(frozen, acts, setup)
    sampling = generation_bytes(facts, acts, setup, generation, compute, gathered) if generation else 0
    peak = on_device_params + on_device_optim + max(forward_end, backward, backward_end, step, sampling) + held
    loaders = 1 if setup.fsdp.cpu_ram_efficient_loading and setup.wrapper != "ddp" else setup.nproc_per_node
    fsdp_comm, tp_comm, sp_comm, cp_comm, ep_comm = collective_bytes(facts, acts, setup, compute, reduce_size)
    return Estimate(setup=setup, params=params, grads=grads, optimizer=optimizer, gathered=gathered,
                    grad_buffers=grad_buffers, activations=activations, loss_transient=loss_transient,
                    optimizer_step_temp=step_temp, device_peak=peak, host_per_rank=host,
                    host_load_per_node=loaders * full_load + setup.nproc_per_node * sum(m.whole_bytes for m in frozen),
                    fsdp_comm=fsdp_comm, tp_comm=tp_comm, sp_comm=sp_comm, cp_comm=cp_comm, ep_comm=ep_comm, frozen=held,
                    generation=sampling)


def collective_bytes(facts: ModelFacts, acts: Activations, setup: Setup, compute: int | None,
                     reduce_size: int | None) -> tuple[int, int, int, int, int]:
    """Bytes one rank moves per optimizer step (every micro-batch of it), on paper, as ring collectives move them:
    a rank receives ``(g - 1) / g`` of what an all-gather over ``g`` ranks gathers, sends as much in a
    reduce-scatter, and twice that in an all-reduce.

    * FSDP (``facts``: a tensor-parallel rank's slices): FULL_SHARD and HYBRID_SHARD gather each layer unit in
      forward and again in backward, the root unit once; SHARD_GRAD_OP each unit once; then the trainable
      gradients are reduce-scattered (reduce dtype), and HYBRID_SHARD all-reduces its shard across the replicas.
      DDP all-reduces every trainable gradient; one process moves nothing.
    * Tensor parallelism: each decoder layer all-reduces its input-sized activations after the attention's and the
      MLP's row-split projections in forward, and the input gradients of its column-split ones in backward (4 per
      layer; activation checkpointing recomputes the 2 forward ones).
    * Sequence parallelism: each layer's queries, keys, values and attention output of the rank's tokens
      (``facts.exchanged_per_token``, in the compute dtype) go through an all-to-all in forward, their gradients in
      backward (activation checkpointing: the forward's again); a rank keeps ``1 / sp`` of each and sends the
      rest.
    * Context parallelism (ring attention, :mod:`hfsdp.parallel.ring`): each layer passes the keys and values of the
      rank's tokens (``facts.kv_per_token``, in the compute dtype) to the next rank ``cp - 1`` times in forward
      (activation checkpointing: again), and in backward ``cp - 1`` times again, with their gradients (float32),
      which go around once more to their owner: ``cp`` passes.
    * Expert parallelism (``facts``: an expert-parallel rank's experts, which FSDP gathers over the ``g / ep`` ranks
      that hold them): each MoE layer sends each token's hidden state to its ``top_k`` experts and the outputs back
      (``facts.routed_per_token``, in the compute dtype), two all-to-alls in forward and two in backward
      (activation checkpointing: the forward's again); with tokens spread evenly over the experts, ``(ep - 1) / ep``
      of them leave the rank."""
    g = setup.dims.shard_group
    accumulation = setup.accumulation
    grads = [sum(p.numel * (reduce_size or p.itemsize) for p in facts.params if p.unit == u and p.trainable)
             for u in range(len(facts.units))]
    if setup.wrapper == "none" or g == 1 and setup.wrapper != "ddp":
        fsdp = 0
    elif setup.wrapper == "ddp":
        fsdp = 2 * sum(grads) * (setup.world - 1) // setup.world
    else:
        twice = setup.strategy != "SHARD_GRAD_OP"  # resharded after the forward: gathered again for the backward

        by_group: dict[int, int] = {}  # bytes gathered (in forward, and backward) and reduce-scattered, by group
        for p in facts.params:
            times = 1 if p.unit == 0 or not twice else 2
            by_group[g // p.ep] = by_group.get(g // p.ep, 0) + p.numel * _gathered_itemsize(p, compute) * times + (
                p.numel * (reduce_size or p.itemsize) if p.trainable else 0)
        fsdp = sum(moved * (group - 1) // group for group, moved in by_group.items())
        replicas = setup.dims.dp_replicate
        if replicas > 1:
            fsdp += 2 * (sum(grads) // g) * (replicas - 1) // replicas
    t = setup.dims.tp
    per_layer = 4 + (2 if setup.fsdp.activation_checkpointing else 0)
    tp = per_layer * sum(acts.layer_inputs) * 2 * (t - 1) // t if t > 1 else 0
    s = setup.dims.sp
    passes = 2 + (1 if setup.fsdp.activation_checkpointing else 0)
    exchanged = facts.exchanged_per_token * acts.tokens * (compute or facts.params[0].itemsize)
    sp = passes * exchanged * (s - 1) // s if s > 1 else 0
    c = setup.dims.cp
    shares = (c - 1) * (3 if setup.fsdp.activation_checkpointing else 2) if c > 1 else 0  # in the compute dtype
    grads = c if c > 1 else 0  # float32
    ring = facts.kv_per_token * acts.tokens * (shares * (compute or facts.params[0].itemsize) + grads * 4)
    e = setup.dims.ep
    routed = facts.routed_per_token * acts.tokens * (compute or facts.params[0].itemsize)
    ep = 2 * passes * routed * (e - 1) // e if e > 1 else 0
    return fsdp * accumulation, tp * accumulation, sp * accumulation, ring * accumulation, ep * accumulation
