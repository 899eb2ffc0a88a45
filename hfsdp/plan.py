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

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from hfsdp import optimizers, quantization
from hfsdp.config import FSDPConfig, HfsdpConfig
from hfsdp.config_files import with_plugins
from hfsdp.distributed import World
from hfsdp.errors import ConfigError, UserError
from hfsdp.fsdp import FSDP_WRAPPERS, Wrapper, check_world, hybrid_mesh_shape, precision_parts, wrapper
from hfsdp.models import layer_classes, meta_model
from hfsdp.units import DTYPE_BYTES, GIB, MIB, PRECISION_DTYPES

# FSDP1 with use_orig_params pads each original parameter inside its flat parameter to a 16-byte boundary.
_FSDP1_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Param:
    numel: int
    rows: int  # dim 0 (FSDP2 shards on it); 1 for a 0-dim tensor
    itemsize: int
    trainable: bool
    unit: int  # index into ModelFacts.units; 0 is the root unit
    cast: bool = True  # mixed precision gathers it in the compute dtype (not packed 4-bit data)
    replicated: bool = False  # kept whole on every rank (uint8-stored 4-bit data)
    weights: int | None = None  # packed 4-bit data: the weights it holds (two a byte)
    shape: tuple[int, ...] = ()  # the whole parameter's (Adafactor's row and column factors)
    hidden: bool = False  # a 2-D matrix of the hidden layers (Muon's; hfsdp.optimizers.hidden_matrices)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: tuple[Param, ...]
    units: tuple[str, ...]  # unit names, root first
    layer_classes: tuple[str, ...]
    vocab_size: int
    num_layers: int
    tied_embeddings: bool
    tied_trainable_numel: int  # the shared input/output embedding, when tied and trained (its 2 gradients add up)
    quant_state_bytes: int = 0  # QLoRA: the 4-bit layers' quant state, on the modules, whole on every rank

    @property
    def total_params(self) -> int:
        return sum(p.weights or p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def unit_bytes(self, unit: int, itemsize: int | None = None) -> int:
        return sum(p.numel * _gathered_itemsize(p, itemsize) for p in self.params if p.unit == unit)


def _gathered_itemsize(p: Param, compute: int | None) -> int:
    return compute if compute and p.cast else p.itemsize


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for backward, for one micro-batch, in the compute dtype."""

    outside_layers: int  # embeddings, final norm, lm_head input
    per_layer: tuple[int, ...]  # each decoder layer's saved tensors
    layer_inputs: tuple[int, ...]  # each decoder layer's input (all that checkpointing keeps of it)
    logits_bytes: int  # one fp32 copy of the micro-batch's logits (the loss transients are counted in these)
    loss_saved: int = 0  # what the plain loss keeps for backward (its float32 log-softmax, logits-sized)
    chunk_bytes: int = 0  # train.chunked_loss: one chunk's float32 logits (hfsdp.loss.LOSS_CHUNK_ELEMENTS), else 0

    def saved(self, checkpointing: bool) -> int:
        # The chunked loss keeps nothing logits-sized: each chunk's gradients are made in the forward.
        outside = self.outside_layers + (0 if self.chunk_bytes else self.loss_saved)
        if not checkpointing:
            return outside + sum(self.per_layer)
        # A checkpointed layer keeps its input; in backward one layer at a time is recomputed in full.
        return outside + sum(self.layer_inputs) + max(self.per_layer, default=0)

    @property
    def loss_forward(self) -> int:
        """Transients at the end of forward: the logits and their float32 copy (the chunked loss: one chunk's)."""
        return 2 * (self.chunk_bytes or self.logits_bytes)

    @property
    def loss_backward(self) -> int:
        """Transients in the loss's backward: the logits' gradient; the chunked loss: one chunk's logits, their
        log-softmax and their gradient, which it makes at the end of the forward together with the head's gradient,
        counted here beside the root's gradients (which hold the head's): an upper bound of that moment."""
        return 3 * self.chunk_bytes if self.chunk_bytes else self.logits_bytes


@dataclass(frozen=True)
class Setup:
    """One table row's knobs: the config's ``fsdp`` section (varied by strategy and by suggested changes) and the
    job's shape."""

    fsdp: FSDPConfig
    nproc_per_node: int
    nodes: int
    plugins: tuple[str, ...]  # enabled, in order (varied when a plugin is suggested)
    accumulation: int
    multi_tensor_adam: bool = True  # torch's AdamW on GPUs; on CPUs it loops over parameters
    async_save: bool = False  # train.async_save: a host-memory copy of the rank's state while a save is in flight
    optimizer: str = "adamw"  # train.optimizer, and its train.optimizer_args
    optimizer_args: tuple[tuple[str, Any], ...] = ()

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
        """What wraps the model, by train's own rule (``hfsdp.fsdp.wrapper``): ``none`` is one process training the
        model as it is (full parameters, gradients and optimizer state, no FSDP buffers)."""
        return wrapper(self.fsdp, self.world)

    @property
    def runs_as(self) -> str:
        """What wraps the model, for the table: FSDP, DDP or nothing."""
        return {"none": "no wrapper", "ddp": "DDP"}.get(self.wrapper, "FSDP")

    @property
    def prefetch(self) -> int:
        """Layer units gathered ahead of the one computing: FSDP1 backward_prefetch (default BACKWARD_PRE), FSDP2's
        implicit prefetch of the next unit."""
        return 0 if self.fsdp.version == 1 and self.fsdp.backward_prefetch == "NONE" else 1

    def shard_group(self) -> int:
        if self.strategy == "NO_SHARD":
            return 1
        mesh = hybrid_mesh_shape(self.fsdp, self.world, self.nproc_per_node)
        return mesh[1] if mesh else self.world


def setup_from_config(config: HfsdpConfig, strategy: str, nproc_per_node: int, nodes: int) -> Setup:
    base = Setup(fsdp=config.fsdp, nproc_per_node=nproc_per_node, nodes=nodes, plugins=tuple(config.plugins),
                 accumulation=config.train.gradient_accumulation_steps, async_save=config.train.async_save,
                 optimizer=config.train.optimizer, optimizer_args=tuple(config.train.optimizer_args.items()))
    # Not validated here: a strategy the rest of the section rules out becomes a row saying why (Planner.problem).
    return replace(base, fsdp=config.fsdp.model_copy(update={"sharding_strategy": strategy}))


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
    problem: str | None = None
    fits: bool | None = None
    suggestion: str | None = None

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


# ---- 1. the model on the meta device


def _unit_of(model, layer_classes: set[str], wrap_policy: str, min_num_params: int | None) -> tuple[dict[int, int], list[str]]:
    """Map id(parameter) -> FSDP unit index, emulating the auto-wrap policy (root = unit 0)."""
    units = ["<root>"]
    owner: dict[int, int] = {}
    if wrap_policy == "transformer":
        for name, module in model.named_modules():
            if type(module).__name__ in layer_classes and name:
                units.append(name)
                for p in module.parameters():
                    owner.setdefault(id(p), len(units) - 1)
    elif wrap_policy == "size":
        from hfsdp.size_policy import size_units  # the units train forms (innermost first)

        modules = dict(model.named_modules())
        for name in size_units(model, min_num_params or 0):
            units.append(name)
            for p in modules[name].parameters():
                owner.setdefault(id(p), len(units) - 1)
    return owner, units


def build_meta_model(model_config, config: HfsdpConfig, host, dtype: str):
    """The architecture on the meta device in ``dtype``, changed by the enabled plugins as training changes it: their
    ``hfsdp_modify_model`` (LoRA's adapters) gets the meta model, no tokenizer and a world of one process; what they
    print meanwhile is not plan's output."""
    import contextlib
    import io
    import warnings

    import torch

    from hfsdp.run_setup import RunSetup

    world = World(rank=0, size=1, local_size=1, on_cpu=False)
    with torch.device("meta"), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # deprecation notices peft triggers in transformers
        # flash-attention and FlexAttention keep what the fused SDPA kernels keep (traced as those, _fused_sdpa).
        attn = "eager" if config.model.attn_implementation == "eager" else "sdpa"
        model = meta_model(model_config, config.model.trust_remote_code, attn)
        model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=None, world=world,
                           setup=RunSetup(config=config, world=world, resume=None))
    return model.to(getattr(torch, dtype))


def model_facts(model_config, config: HfsdpConfig, host) -> ModelFacts:
    model = build_meta_model(model_config, config, host, config.model.dtype)
    classes = layer_classes(config.fsdp, model_config)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    shared = model.get_input_embeddings().weight
    tied_numel = shared.numel() if tied and shared.requires_grad else 0
    owner, units = _unit_of(model, set(classes), config.fsdp.wrap_policy, config.fsdp.min_num_params)
    quant = quantization.settings(config)
    packed = {id(m.weight): m.weight.numel() for m in quantization.linears_to_quantize(model)} if quant else {}
    params = []
    hidden = optimizers.hidden_matrices(model)
    for name, p in model.named_parameters():  # tied parameters appear once
        unit = owner.get(id(p), 0)
        if id(p) not in packed:
            params.append(Param(numel=p.numel(), rows=p.shape[0] if p.dim() else 1, itemsize=p.element_size(),
                                trainable=p.requires_grad, unit=unit, shape=tuple(p.shape), hidden=name in hidden))
            continue
        # bitsandbytes packs two 4-bit weights a byte, stored as a [bytes / itemsize, 1] tensor; the quant state
        # stays on the module, whole on every rank
        itemsize = quantization.ITEMSIZE[quant.quant_storage]
        rows = p.numel() // 2 // itemsize
        params.append(Param(numel=rows, rows=rows, itemsize=itemsize, trainable=False, unit=unit, cast=False,
                            replicated=quant.quant_storage == "uint8", weights=p.numel()))
    params = tuple(params)
    return ModelFacts(name=config.model.name_or_path, params=params, units=tuple(units),
                      layer_classes=tuple(classes), vocab_size=model_config.vocab_size,
                      num_layers=sum(type(m).__name__ in classes for m in model.modules()),
                      tied_embeddings=tied, tied_trainable_numel=tied_numel,
                      quant_state_bytes=sum(quant.state_bytes(n) for n in packed.values()) if quant else 0)


# ---- 2. activations, traced on the meta device


def _fused_sdpa():
    """``scaled_dot_product_attention`` as the fused kernels (flash / memory-efficient on GPUs, flash on CPUs)
    behave for memory: they save q, k, v, the output and a float32 log-sum-exp per query and head."""
    import torch

    class FusedSDPA(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # never called: the trace runs no backward
            raise NotImplementedError

    def sdpa(query, key, value, *args, **kwargs):
        return FusedSDPA.apply(query, key, value)

    return sdpa


def trace_activations(model_config, config: HfsdpConfig, host, precision: str, objective=None) -> Activations:
    """Saved tensors of one training micro-batch (``train.per_device_batch_size`` x ``data.max_seq_len`` tokens,
    times a plugin ``objective``'s sequences per row) in the compute dtype of ``precision``. Only the default
    objective runs the chunked loss (``train.chunked_loss``); a plugin's computes the full logits."""
    import contextlib
    from unittest import mock

    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from hfsdp.loss import token_loss_sum

    batch, seq = config.train.per_device_batch_size, config.data.max_seq_len
    batch *= objective.sequences_per_row if objective is not None else 1
    chunked = config.train.chunked_loss and objective is None
    model = build_meta_model(model_config, config, host, compute_dtype(config, precision))
    model.train()
    classes = set(layer_classes(config.fsdp, model_config))
    params = {id(p) for p in model.parameters()}
    current: list[int | None] = [None]
    saved: dict[int, tuple[int | None, int]] = {}  # id(storage owner) -> (layer, bytes)
    inputs: dict[int, int] = {}
    layer_inputs: list[int] = []
    keep: list[Any] = []  # saved tensors stay alive, so ids are not reused during the trace

    def pack(t):
        base = t._base if t._base is not None else t
        keep.append(t)
        if id(base) not in params and id(t) not in params and id(base) not in saved:
            saved[id(base)] = (current[0], base.numel() * base.element_size())
        return t

    layers = [m for m in model.modules() if type(m).__name__ in classes]
    hooks = []
    for index, layer in enumerate(layers):
        def pre(module, args, kwargs, index=index):
            current[0] = index
            # What a checkpointed layer keeps: its tensor inputs (shared ones, like rotary tables, once).
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for v in kwargs.values() if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
            fresh = 0
            for t in tensors:
                if id(t) not in inputs:
                    inputs[id(t)] = t.numel() * t.element_size()
                    keep.append(t)
                    fresh += inputs[id(t)]
            layer_inputs.append(fresh)

        def post(module, args, output):
            current[0] = None

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post))
    patch = (mock.patch.object(F, "scaled_dot_product_attention", _fused_sdpa())
             if config.model.attn_implementation != "eager" else contextlib.nullcontext())
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # What the plain loss saves after the model's forward (train.chunked_loss keeps none of it).
    hooks.append(model.register_forward_hook(lambda module, args, output: current.__setitem__(0, "loss")))
    try:
        with patch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # The plain loss itself, on a batch of rows without padding. use_cache left on: an empty cache holds only
            # the keys and values backward saves anyway (training turns it off); off, transformers looks for packed
            # rows with a .item() that meta tensors cannot answer.
            loss = token_loss_sum(model, SimpleNamespace(inputs={"input_ids": ids}, targets=ids))
            del loss
    finally:
        for h in hooks:
            h.remove()
    per_layer = [0] * len(layers)
    outside = loss_saved = 0
    for layer, nbytes in saved.values():
        if layer is None:
            outside += nbytes
        elif layer == "loss":
            loss_saved += nbytes
        else:
            per_layer[layer] += nbytes
    from hfsdp.loss import LOSS_CHUNK_ELEMENTS

    vocab = model_config.vocab_size
    chunk = min(max(1, LOSS_CHUNK_ELEMENTS // vocab), batch * seq) * vocab * 4 if chunked else 0
    return Activations(outside_layers=outside, per_layer=tuple(per_layer), layer_inputs=tuple(layer_inputs),
                       logits_bytes=batch * seq * vocab * 4, loss_saved=loss_saved, chunk_bytes=chunk)


def compute_dtype(config: HfsdpConfig, precision: str) -> str:
    return PRECISION_DTYPES.get(precision, config.model.dtype)


# ---- 3. arithmetic


def _chunk(n: int, parts: int, rank: int) -> int:
    """Elements of ``n`` that ``torch.chunk`` gives to ``rank`` of ``parts`` (FSDP2's dim-0 sharding)."""
    size = -(-n // parts)
    return max(0, min(size, n - rank * size))


def _fsdp2_bytes(facts: ModelFacts, group: int, select: Callable[[Param], bool]) -> int:
    """The largest rank's bytes of the selected parameters, each split on dim 0 across ``group`` ranks."""
    return max(sum((p.numel if p.replicated else _chunk(p.rows, group, r) * (p.numel // max(p.rows, 1))) * p.itemsize
                   for p in facts.params if select(p)) for r in range(group))


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
    group = setup.shard_group()
    if setup.wrapper in ("ddp", "none"):
        return sum(p.numel * p.itemsize for p in facts.params if select(p))
    if setup.fsdp.version == 1:
        return _fsdp1_bytes(facts, group, select, setup.fsdp.use_orig_params is not False, whole_flat)
    return _fsdp2_bytes(facts, group, select)


def optimizer_bytes(facts: ModelFacts, setup: Setup) -> int:
    """The largest rank's bytes of optimizer state (tensors of one or more dimensions, each storage once, as
    bench counts them), as each ``train.optimizer`` allocates it for the trainable parameters: AdamW and
    schedule-free AdamW two parameter-sized tensors (moments; z and the second moment), SGD one with momentum,
    Muon one momentum for its hidden matrices and AdamW's two for the rest, sharded as the gradients are; Adafactor
    a row and a column factor per matrix and a full second moment per vector, under FSDP2 the rows' share of the
    row factors and moments and the whole column factors (:class:`hfsdp.optimizers.ShardedAdafactor`); 8-bit AdamW two
    bytes per element plus two float32 block scales per 256 elements and the two 256-entry quantization maps all
    parameters share, with parameters under ``min_8bit_size`` elements (whole) in float32: under FSDP2 those of the
    rank's shard, and whole on every rank for a parameter whose shards do not fall on the 256-element blocks
    (:func:`hfsdp.optimizers.blocks_follow_shards`: it runs on the gathered tensor)."""
    from hfsdp.optimizers import BNB_BLOCK, BNB_MIN_8BIT, blocks_follow_shards

    args = dict(setup.optimizer_args)
    trainable = [p for p in facts.params if p.trainable]
    select = lambda hidden: lambda p: p.trainable and p.hidden == hidden  # noqa: E731
    if setup.optimizer == "muon":
        return sharded_bytes(facts, setup, select(True)) + 2 * sharded_bytes(facts, setup, select(False))
    if setup.optimizer == "sgd":
        return sharded_bytes(facts, setup, lambda p: p.trainable) if args.get("momentum", 0) else 0
    if setup.optimizer == "adafactor":
        group = setup.shard_group() if setup.wrapper == "fsdp2" else 1

        def factors(p: Param, rank: int) -> int:  # row factors and vector moments sharded as the rows, columns whole
            rows = _chunk(p.rows, group, rank) if group > 1 else p.rows
            if len(p.shape) >= 2:
                return 4 * (rows * (p.numel // p.shape[-1]) // max(p.rows, 1) + p.numel // p.shape[-2])
            return 4 * rows * (p.numel // max(p.rows, 1))

        return max(sum(factors(p, rank) for p in trainable) for rank in range(group))
    if setup.optimizer == "adamw_8bit":
        small = args.get("min_8bit_size", BNB_MIN_8BIT)
        quantized = [p for p in trainable if p.numel >= small]
        group = setup.shard_group() if setup.wrapper == "fsdp2" else 1

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


def estimate(facts: ModelFacts, acts: Activations, setup: Setup) -> Estimate:
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
      (a second copy of every gradient) plus the tied embedding's second gradient.
    * activations: what autograd saves for one micro-batch (traced), with checkpointing: the layer inputs plus one
      recomputed layer. The loss adds transients: two float32 logits-sized tensors at the end of forward (the
      logits, their reshaped copy, the float32 upcast), one in backward (the logits' gradient), beside the saved
      float32 log-softmax. With ``train.chunked_loss`` nothing logits-sized is saved, and the transients are one
      chunk's (``hfsdp.loss.LOSS_CHUNK_ELEMENTS`` logits): two at the end of forward, and three (the logits, their
      log-softmax and their gradient, which it makes at the end of the forward with the head's gradient) counted
      in backward beside the root's gradients, an upper bound of that moment.
    * peak = parameters + optimizer + the largest of four moments: the end of forward (gathered + activations +
      loss transients), backward (gathered + the root's and one layer's gradient buffers + activations + one
      logits-sized gradient), the end of backward (gathered + the root's buffers + gradients), the optimizer step
      (gradients + AdamW's temporaries: one state-sized tensor on GPUs, where it runs multi-tensor; one
      parameter's worth on CPUs). With gradient accumulation, the earlier micro-batches' gradients are there
      during forward and backward too.
    * CPU offload moves parameters, gradients and optimizer state to host memory (``host_per_rank``).
    * ``train.async_save`` stages a copy of the rank's parameters and optimizer state in host memory while a save
      is written (one save in flight at a time): added to ``host_per_rank`` where FSDP wraps the model.
    * host RAM at load, per node: every rank reads the full model in ``model.dtype``, or only rank 0 with
      cpu_ram_efficient_loading (FSDP only).
    """
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
    group = setup.shard_group()
    if setup.wrapper == "none" or setup.strategy == "NO_SHARD" or (setup.fsdp.version == 1 and group == 1):
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
    tied_grad = facts.tied_trainable_numel * facts.params[0].itemsize
    if setup.wrapper == "none":
        # Autograd alone: the tied weight's second gradient meets the first at the end.
        during, at_end = 0, tied_grad
    elif setup.wrapper == "ddp":
        # DDP's buckets hold a second copy of every gradient; the tied weight's two gradients meet at the end.
        buckets = sum(p.numel * p.itemsize for p in facts.params if p.trainable)
        during, at_end = buckets, buckets + tied_grad
    else:
        tied = facts.tied_trainable_numel * (compute or facts.params[0].itemsize)
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
        (p.numel * p.itemsize // setup.shard_group() for p in facts.params if p.trainable), default=0)
    on_device_params, on_device_grads, on_device_optim = params, grads, optimizer
    host = 0
    if setup.fsdp.cpu_offload:
        host = params + grads + optimizer
        on_device_params = on_device_grads = on_device_optim = step_temp = 0
    if setup.async_save and setup.wrapper in FSDP_WRAPPERS:
        host += params + optimizer
    earlier_grads = on_device_grads if setup.accumulation > 1 else 0
    # The loss: at the end of forward the logits, their reshaped copy and float32 upcast sit beside the saved
    # log-softmax (``loss_transient``); in backward one logits-sized gradient at a time. The chunked loss: the
    # same for one chunk, and its gradients' transients beside the head's gradient (``Activations.loss_backward``).
    forward_end = gathered + activations + loss_transient + earlier_grads
    backward = gathered + during + activations + acts.loss_backward + earlier_grads
    backward_end = gathered + at_end + on_device_grads
    step = on_device_grads + step_temp
    peak = on_device_params + on_device_optim + max(forward_end, backward, backward_end, step)
    full_load = sum(p.numel * p.itemsize for p in facts.params)
    loaders = 1 if setup.fsdp.cpu_ram_efficient_loading and setup.wrapper != "ddp" else setup.nproc_per_node
    return Estimate(setup=setup, params=params, grads=grads, optimizer=optimizer, gathered=gathered,
                    grad_buffers=grad_buffers, activations=activations, loss_transient=loss_transient,
                    optimizer_step_temp=step_temp, device_peak=peak, host_per_rank=host,
                    host_load_per_node=loaders * full_load)


# ---- the plan: rows, fits, and the cheapest change that fits


@dataclass
class Planner:
    """Estimates for variations of one config; facts and traces are computed once per variation that needs them."""

    model_config: Any
    config: HfsdpConfig
    budget: int
    _variants: dict = field(default_factory=dict)
    _objectives: dict = field(default_factory=dict)
    _facts: dict = field(default_factory=dict)
    _traces: dict = field(default_factory=dict)

    def variant(self, plugins: tuple[str, ...]):
        """The config with ``plugins`` enabled (its own, or with a suggested plugin added, validated again:
        ConfigError) and their plugin host."""
        if plugins not in self._variants:
            from hfsdp.plugins import PluginHost

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
            self._objectives[plugins] = objective_of(host, config, None)
        return self._objectives[plugins]

    def facts(self, plugins: tuple[str, ...]) -> ModelFacts:
        if plugins not in self._facts:
            self._facts[plugins] = model_facts(self.model_config, *self.variant(plugins))
        return self._facts[plugins]

    def estimate(self, setup: Setup) -> Estimate:
        facts = self.facts(setup.plugins)
        key = (setup.plugins, compute_dtype(self.config, setup.precision))
        if key not in self._traces:
            self._traces[key] = trace_activations(self.model_config, *self.variant(setup.plugins), setup.precision,
                                                  self.objective(setup.plugins))
        acts = self._traces[key]
        est = estimate(facts, acts, setup)
        est.problem = self.problem(setup)
        if est.problem is None:
            est.fits = est.device_peak <= self.budget
        return est

    def problem(self, setup: Setup) -> str | None:
        """Why this combination cannot run at all, by the checks training makes before any weight loads: the
        ``fsdp`` section's own rules, the world checks, and what the enabled plugins refuse (their config checks,
        and their ``hfsdp_before_model_load`` for this world, e.g. LoRA's FSDP1 single-shard refusal)."""
        from hfsdp.run_setup import RunSetup

        try:
            FSDPConfig.model_validate(setup.fsdp.model_dump())
        except ValueError as err:
            return "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        train = self.config.train.model_copy(update={"optimizer": setup.optimizer})
        problems = check_world(setup.fsdp, setup.world, setup.nproc_per_node) + optimizers.wrapper_problems(
            self.config.model_copy(update={"train": train}), setup.wrapper)  # e.g. Adafactor where FSDP2 shards
        if problems:
            return problems[0][1]
        config, host = self.variant(setup.plugins)
        config = config.model_copy(update={"fsdp": setup.fsdp})
        problems = host.validation_problems(config)
        if not problems:
            world = World(rank=0, size=setup.world, local_size=setup.nproc_per_node, on_cpu=False)
            try:
                host.call("hfsdp_before_model_load", config=config, world=world, model_config=self.model_config,
                          setup=RunSetup(config=config, world=world, resume=None))
            except ConfigError as err:
                problems = err.problems
        return f"{problems[0][0]}: {problems[0][1]}" if problems else None  # a plugin's: with the key it names

    def suggest(self, setup: Setup, more_ranks: list[int]) -> str | None:
        """The cheapest set of changes that makes ``setup`` fit, written as the ``--set`` (and ``--nproc``) it
        takes and checked by the same estimate. The changes, cheapest first: those that keep the hardware and the
        training maths (FULL_SHARD, activation checkpointing), then precision (bf16), AdamW's moments in 8 bits
        (``train.optimizer=adamw_8bit``: 2 bytes a parameter instead of 8, plus its block scales), more ranks per
        node (fewer first), LoRA, CPU offload (slowest). Sets are tried in order of cost (:func:`change_sets`): the costliest
        change a set needs, then how many changes it makes, so a change that fits alone is never printed with
        others it does not need."""
        changes: list[Change] = []
        if setup.strategy != "FULL_SHARD":
            changes.append(Change("fsdp.sharding_strategy=FULL_SHARD", fsdp={"sharding_strategy": "FULL_SHARD"}))
        if not setup.fsdp.activation_checkpointing:
            changes.append(Change("fsdp.activation_checkpointing=true", fsdp={"activation_checkpointing": True}))
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


def plan(planner: Planner, strategies: list[str], nprocs: list[int], nodes: int) -> list[Estimate]:
    """One estimate per world size x strategy; rows that do not fit carry the cheapest change that would."""
    rows = []
    for nproc in nprocs:
        for strategy in strategies:
            setup = setup_from_config(planner.config, strategy, nproc, nodes)
            est = planner.estimate(setup)
            if est.fits is False:
                # More ranks: the larger listed sizes, then twice and four times the largest.
                est.suggestion = planner.suggest(setup, [n for n in nprocs if n > nproc] + [2 * max(nprocs),
                                                                                           4 * max(nprocs)])
            rows.append(est)
    return rows


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def table_unit(rows: list[Estimate]) -> tuple[str, int]:
    """GiB when some row peaks above 1 GiB, MiB otherwise."""
    return ("GiB", GIB) if max((e.device_peak for e in rows), default=0) >= GIB else ("MiB", MIB)


def _columns(unit: int) -> list[tuple[str, Callable[[Estimate], str]]]:
    def size(n: int) -> str:
        return f"{n / unit:.2f}"

    return [
        ("ranks", lambda e: f"{e.setup.world}" + (f" ({e.setup.nodes}x{e.setup.nproc_per_node})"
                                                    if e.setup.nodes > 1 else "")),
        ("strategy", lambda e: e.setup.strategy + ("" if e.setup.runs_as == "FSDP" else f" ({e.setup.runs_as})")),
        ("params", lambda e: size(e.params)),
        ("grads", lambda e: size(e.grads)),
        ("optim", lambda e: size(e.optimizer)),
        ("gathered", lambda e: size(e.gathered)),
        ("activ.", lambda e: size(e.activations + e.loss_transient)),
        ("peak/rank", lambda e: size(e.device_peak)),
        ("host/rank", lambda e: size(e.host_per_rank)),
        ("load RAM/node", lambda e: size(e.host_load_per_node)),
        ("fits", lambda e: "-" if e.problem else ("yes" if e.fits else "NO")),
        ("cheapest change that fits", lambda e: e.problem or e.suggestion or ("-" if e.fits else "none of the listed")),
    ]


def text_table(rows: list[Estimate]) -> str:
    columns = _columns(table_unit(rows)[1])
    cells = [[h for h, _ in columns]] + [[f(e) for _, f in columns] for e in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    left = (1, len(columns) - 1)
    return "\n".join("  ".join(c[i].ljust(widths[i]) if i in left else c[i].rjust(widths[i])
                               for i in range(len(columns))).rstrip() for c in cells)


def header(facts: ModelFacts, config: HfsdpConfig, budget: int, rows: list[Estimate], objective=None) -> str:
    fsdp = config.fsdp
    adapted = facts.trainable_params < facts.total_params
    if objective is not None:
        n = objective.sequences_per_row
        loss = f"{type(objective).__name__} ({n} sequence{'s' if n != 1 else ''} a row, full logits)"
    else:
        loss = "chunked" if config.train.chunked_loss else "plain (full logits)"
    return (f"{facts.name}: {_count(facts.total_params)} parameters"
            + (f" ({_count(facts.trainable_params)} trainable)" if adapted else "")
            + f", {facts.num_layers} layers in {len(facts.units)} FSDP units; weights {config.model.dtype}, "
            f"mixed precision {fsdp.precision_name}, FSDP{fsdp.version}, activation checkpointing "
            f"{'on' if fsdp.activation_checkpointing else 'off'}, cpu offload {'on' if fsdp.cpu_offload else 'off'}\n"
            f"micro-batch {config.train.per_device_batch_size} x {config.data.max_seq_len} tokens, "
            f"attention {config.model.attn_implementation}, loss {loss}; device budget {budget / GIB:.1f} GiB per rank; "
            f"sizes in {table_unit(rows)[0]} per rank" + quantized_line(facts, config))


def quantized_line(facts: ModelFacts, config: HfsdpConfig) -> str:
    """QLoRA: what the 4-bit base costs beside what it would in the compute dtype."""
    quant = quantization.settings(config)
    packed = [p for p in facts.params if p.weights]
    if not packed:
        return ""
    state = facts.quant_state_bytes
    packed_bytes = sum(p.numel * p.itemsize for p in packed)
    weights = sum(p.weights for p in packed)
    where = "whole on every rank (uint8 storage)" if quant.quant_storage == "uint8" else "sharded by FSDP2"
    return (f"\n4-bit base ({quant.quant_type}{', double quant' if quant.double_quant else ''}, stored "
            f"{quant.quant_storage}): {_count(weights)} weights in {packed_bytes / GIB:.2f} GiB packed, {where}, "
            f"+ {state / GIB:.2f} GiB quant state on every rank; in bf16 they would be {2 * weights / GIB:.2f} GiB "
            f"({(packed_bytes + state) / (2 * weights):.2f} of it)")


def to_json(rows: list[Estimate], facts: ModelFacts, budget: int) -> dict[str, Any]:
    out = []
    for e in rows:
        d = {k: v for k, v in asdict(e).items() if k != "setup"}
        d.update(strategy=e.setup.strategy, nproc_per_node=e.setup.nproc_per_node, nodes=e.setup.nodes,
                 world=e.setup.world, shard_group=e.setup.shard_group(), runs_as_ddp=e.setup.fsdp.runs_as_ddp,
                 runs_as=e.setup.runs_as,
                 plugins=list(e.setup.plugins), fsdp=e.setup.fsdp.model_dump(mode="json"), state=e.state)
        out.append(d)
    return {"model": facts.name, "parameters": facts.total_params, "trainable_parameters": facts.trainable_params,
            "fsdp_units": len(facts.units), "fsdp_unit_names": list(facts.units), "device_budget_bytes": budget, "rows": out}


def plot(rows: list[Estimate], budget: int, path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'hfsdp[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(e.setup.strategy for e in rows):
        points = [(e.setup.world, e.device_peak / GIB) for e in rows if e.setup.strategy == strategy and not e.problem]
        if points:
            ax.plot(*zip(*points), marker="o", label=strategy)
    ax.axhline(budget / GIB, color="red", linestyle="--", label=f"budget {budget / GIB:.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted peak GiB per rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
