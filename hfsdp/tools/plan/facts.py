"""What ``hfsdp plan`` knows of a model before anything loads (step 1 of :mod:`hfsdp.tools.plan.planner`): the model
built on the meta device and changed by the enabled plugins' ``hfsdp_modify_model`` as training changes it; each
parameter's shape, dtype, trainability and FSDP unit (the wrap policy, emulated); and the traced step's activations
(:class:`Activations`, made by :mod:`hfsdp.tools.plan.trace`)."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace

from hfsdp.config.schema import HfsdpConfig
from hfsdp.model import experts, quantized
from hfsdp.model.loading import build_meta_model, layer_classes
from hfsdp.rules import parallel, quantization
from hfsdp.rules.experts import experts_of
from hfsdp.run import optimizers
from hfsdp.setup.decide import one_process
from hfsdp.units import DTYPE_BYTES


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
    hidden: bool = False  # a 2-D matrix of the hidden layers (Muon's; hfsdp.run.optimizers.hidden_matrices)
    tp_style: str | None = None  # parallel.tp_size: how the architecture's plan splits it (colwise, rowwise)
    routed: bool = False  # a routed experts' weight (dim 0 the experts), which parallel.ep_size splits
    in_experts: bool = False  # in an experts module (its weights, peft's adapters of them): FSDP2 shards it apart
    ep: int = 1  # parallel.ep_size where it is in_experts: FSDP2 shards it over shard_group / ep ranks

    def tp_local(self, tp: int) -> "Param":
        """The largest tensor-parallel rank's slice (``torch.chunk``'s first): colwise splits dim 0 (a bias too),
        rowwise the last dim of a matrix (its bias stays whole); FSDP2 then shards the slice's dim 0."""
        if tp == 1 or self.tp_style is None or not self.shape:
            return self
        dim = 0 if self.tp_style == "colwise" else len(self.shape) - 1
        if self.tp_style == "rowwise" and len(self.shape) < 2:
            return self
        shape = list(self.shape)
        shape[dim] = _chunk(shape[dim], tp, 0)
        return replace(self, numel=math.prod(shape), rows=shape[0], shape=tuple(shape))

    def ep_local(self, ep: int) -> "Param":
        """What a rank of an expert-parallel group of ``ep`` keeps: its experts of a routed experts' weight
        (``Shard(0)``: ep divides the experts), an adapter of them whole; other parameters as they are."""
        if ep == 1 or not self.in_experts:
            return self
        if not self.routed:
            return replace(self, ep=ep)
        rows = self.rows // ep
        return replace(self, numel=self.numel // ep, rows=rows, shape=(rows, *self.shape[1:]), ep=ep)


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
    kv_per_token: int = 0  # elements the KV cache holds per token: keys and values of every layer's KV heads
    # elements per token that sequence parallelism's all-to-alls exchange in a forward: every layer's queries, keys,
    # values and attention output
    exchanged_per_token: int = 0
    # a mixture of experts: the parameters a token computes with (each MoE layer's top_k routed experts of its
    # count, everything else); None for a dense model
    active_params: int | None = None
    experts: int = 0  # a mixture of experts: the routed experts of each MoE layer
    # elements per token that expert parallelism's all-to-alls send in a forward: each MoE layer's hidden state
    # once for each of its top_k experts, out and back
    routed_per_token: int = 0

    def ep_local(self, ep: int) -> "ModelFacts":
        """What one rank of an expert-parallel group of ``ep`` keeps of each MoE layer's experts (FSDP2 shards them
        over the ``shard_group / ep`` ranks holding the same ones)."""
        return self if ep == 1 else replace(self, params=tuple(p.ep_local(ep) for p in self.params))

    def tp_local(self, tp: int) -> "ModelFacts":
        """What one rank of a tensor-parallel group of ``tp`` keeps before FSDP2 shards it (the largest slices)."""
        return self if tp == 1 else replace(self, params=tuple(p.tp_local(tp) for p in self.params),
                                            kv_per_token=-(-self.kv_per_token // tp))

    @property
    def total_params(self) -> int:
        return sum(p.weights or p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def unit_bytes(self, unit: int, itemsize: int | None = None) -> int:
        return sum(p.numel * _gathered_itemsize(p, itemsize) for p in self.params if p.unit == unit)


@dataclass(frozen=True)
class Images:
    """What ``hfsdp plan`` traced of a vision-language model's vision tower for one micro-batch: ``count`` images
    of ``tokens`` image tokens each (the language model's tokens they become), the tower's saved tensors for all of
    them ``saved`` bytes (what is kept for the backward: 0 where nothing before the tower's output is trained)."""

    count: int
    tokens: int
    saved: int


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for backward, for one micro-batch, in the compute dtype."""

    outside_layers: int  # embeddings, final norm, lm_head input
    per_layer: tuple[int, ...]  # each decoder layer's saved tensors
    layer_inputs: tuple[int, ...]  # each decoder layer's input (all that checkpointing keeps of it)
    logits_bytes: int  # one fp32 copy of the micro-batch's logits (the loss transients are counted in these)
    loss_saved: int = 0  # what the plain loss keeps for backward (its float32 log-softmax, logits-sized)
    chunk_bytes: int = 0  # train.chunked_loss: one chunk's float32 logits (hfsdp.model.token_loss.LOSS_CHUNK_ELEMENTS), else 0
    tokens: int = 0  # the traced micro-batch's (sequences x tokens)
    chunk_count: int = 0  # train.chunked_loss: the micro-batch's chunks
    last_chunk_bytes: int = 0  # the last chunk's float32 logits (the micro-batch's remainder)
    head_grad_bytes: int = 0  # the head's gradient it computes (of the head's trainable parameters; LoRA: 0)
    one_tied_gradient: bool = False  # train.chunked_loss: the tied input embedding adds its gradient into the head's
    images: Images | None = None  # a vision-language model's images in the micro-batch (counted in the fields above)

    def saved(self, checkpointing: bool) -> int:
        # The chunked loss keeps nothing logits-sized: each chunk's gradients are made in the forward.
        outside = self.outside_layers + (0 if self.chunk_bytes else self.loss_saved)
        if not checkpointing:
            return outside + sum(self.per_layer)
        # A checkpointed layer keeps its input; in backward one layer at a time is recomputed in full.
        return outside + sum(self.layer_inputs) + max(self.per_layer, default=0)

    @property
    def loss_forward(self) -> int:
        """Transients at the end of forward: the logits and their float32 copy. The chunked loss makes each chunk's
        gradients there, chunk after chunk (measured on CPU, 256 to 1,024 positions of a 49,152 x 512 head: within
        5 MiB): three chunk-sized tensors at its log-softmax's backward (the log-softmax, the gradient of the loss
        with respect to it, the logits' gradient), then the logits' gradient beside the head's gradient it makes;
        from the second chunk on, the head's gradient of the chunks before is there too, and beside a chunk's own
        until that is added to it."""
        if not self.chunk_bytes:
            return 2 * self.logits_bytes
        head, first = self.head_grad_bytes, self.chunk_bytes
        peak = max(3 * first, first + head)
        if self.chunk_count > 1:
            later = first if self.chunk_count > 2 else self.last_chunk_bytes
            peak = max(peak, head + 3 * later, later + 2 * head)
        return peak

    def scaled(self, factor: float) -> "Activations":
        """These activations for ``factor`` times the traced tokens, each part that grows with them scaled (the
        loss's chunks counted again): what a longer row saves where attention saves a few tensors per position
        (sdpa's fused kernels and flash attention; eager's scores grow with the square of a row)."""
        n = lambda b: int(b * factor)  # noqa: E731
        if not self.chunk_count:
            chunks = {}
        else:
            per_chunk = self.chunk_bytes
            total = per_chunk * (self.chunk_count - 1) + self.last_chunk_bytes
            count = max(1, -(-n(total) // per_chunk))
            chunks = {"chunk_count": count, "last_chunk_bytes": n(total) - per_chunk * (count - 1)}
        return replace(self, outside_layers=n(self.outside_layers), per_layer=tuple(map(n, self.per_layer)),
                       layer_inputs=tuple(map(n, self.layer_inputs)), logits_bytes=n(self.logits_bytes),
                       loss_saved=n(self.loss_saved), tokens=n(self.tokens), **chunks)

    @property
    def loss_backward(self) -> int:
        """Transients in the loss's backward: the logits' gradient; the chunked loss: none (its backward scales the
        gradients it made in the forward, in place)."""
        return 0 if self.chunk_bytes else self.logits_bytes


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
        from hfsdp.parallel.size_policy import size_units  # the units train forms (innermost first)

        modules = dict(model.named_modules())
        for name in size_units(model, min_num_params or 0):
            units.append(name)
            for p in modules[name].parameters():
                owner.setdefault(id(p), len(units) - 1)
    return owner, units


def model_facts(model_config, config: HfsdpConfig, host) -> ModelFacts:
    model = build_meta_model(model_config, one_process(config), host, config.model.dtype)
    classes = layer_classes(config.fsdp, model_config)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    shared = model.get_input_embeddings().weight
    tied_numel = shared.numel() if tied and shared.requires_grad else 0
    owner, units = _unit_of(model, set(classes), config.fsdp.wrap_policy, config.fsdp.min_num_params)
    quant = quantization.settings(config)
    packed = {id(m.weight): m.weight.numel() for m in quantized.linears_to_quantize(model)} if quant else {}
    params = []
    hidden = optimizers.hidden_matrices(model)
    styles = tp_styles(model, parallel.tp_plan(model_config))
    in_experts = experts.routed_parameters(model)
    routed = {id(p) for m in model.modules() if experts.is_experts(m) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():  # tied parameters appear once
        unit = owner.get(id(p), 0)
        if id(p) not in packed:
            params.append(Param(numel=p.numel(), rows=p.shape[0] if p.dim() else 1, itemsize=p.element_size(),
                                trainable=p.requires_grad, unit=unit, shape=tuple(p.shape), hidden=name in hidden,
                                tp_style=styles.get(name), routed=id(p) in routed, in_experts=id(p) in in_experts))
            continue
        # bitsandbytes packs two 4-bit weights a byte, stored as a [bytes / itemsize, 1] tensor; the quant state
        # stays on the module, whole on every rank
        itemsize = quantization.ITEMSIZE[quant.quant_storage]
        rows = p.numel() // 2 // itemsize
        params.append(Param(numel=rows, rows=rows, itemsize=itemsize, trainable=False, unit=unit, cast=False,
                            replicated=quant.quant_storage == "uint8", weights=p.numel()))
    params = tuple(params)
    counted = experts.active_numel(model, model_config)
    active = sum(counted(p) for p in model.parameters()) if in_experts else None
    moe = experts_of(model_config)
    moe_layers = sum(1 for m in model.modules() if experts.is_experts(m))
    return ModelFacts(name=config.model.name_or_path, params=params, units=tuple(units),
                      layer_classes=tuple(classes), vocab_size=model_config.get_text_config().vocab_size,
                      num_layers=sum(type(m).__name__ in classes for m in model.modules()),
                      tied_embeddings=tied, tied_trainable_numel=tied_numel,
                      quant_state_bytes=sum(quant.state_bytes(n) for n in packed.values()) if quant else 0,
                      kv_per_token=kv_elements_per_token(model_config),
                      exchanged_per_token=exchanged_elements_per_token(model_config),
                      active_params=round(active) if active is not None else None,
                      experts=moe.count if moe else 0,
                      routed_per_token=moe_layers * moe.top_k * parallel.text_config(model_config).hidden_size
                      if moe else 0)


def _attention_shape(model_config) -> tuple[int, int, int, int]:
    """(layers, heads, KV heads, head width) of the model's text config."""
    text = parallel.text_config(model_config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, getattr(text, "num_key_value_heads", None) or heads, head_dim


def kv_elements_per_token(model_config) -> int:
    """Elements of the KV cache per token: a key and a value of ``head_dim`` for each KV head of each layer (as
    transformers' ``DynamicCache`` holds them)."""
    layers, _, kv_heads, head_dim = _attention_shape(model_config)
    return 2 * layers * kv_heads * head_dim


def exchanged_elements_per_token(model_config) -> int:
    """Elements per token that a forward under sequence parallelism exchanges (:mod:`hfsdp.parallel.sequence`): in
    every layer the queries and the attention output (``heads x head_dim`` each) and the keys and values (the KV
    heads')."""
    layers, heads, _, head_dim = _attention_shape(model_config)
    return 2 * layers * heads * head_dim + kv_elements_per_token(model_config)


def tp_styles(model, plan: dict[str, str]) -> dict[str, str]:
    """Parameter name -> the plan's style for its module (the plan's paths start at the base model, ``*`` a layer
    index), as :func:`hfsdp.parallel.tensor.parallelize` applies it."""
    prefix = getattr(model, "base_model_prefix", "")
    styles = {}
    for name, _ in model.named_parameters():
        module = name.rsplit(".", 1)[0].removeprefix(f"{prefix}.")
        style = next((s for path, s in plan.items() if fnmatch.fnmatchcase(module, path)), None)
        if style is not None:
            styles[name] = style
    return styles


@dataclass(frozen=True)
class FrozenFacts:
    """A frozen model an objective runs beside the trained one (:class:`hfsdp.objective.FrozenModel`): its
    parameters (none trainable, all in one unit); each rank loads it whole before any sharding."""

    name: str
    params: tuple[Param, ...]
    sharded_by_fsdp2: bool
    keeps_logits: bool

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def itemsize(self) -> int:
        return self.params[0].itemsize

    @property
    def whole_bytes(self) -> int:
        return self.numel * self.itemsize


def frozen_facts(frozen) -> FrozenFacts:
    """The parameters of a :class:`hfsdp.objective.FrozenModel`, built on the meta device from its config."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(frozen.model_config)
    itemsize = DTYPE_BYTES[frozen.dtype]
    params = tuple(Param(numel=p.numel(), rows=p.shape[0] if p.dim() else 1, itemsize=itemsize, trainable=False,
                         unit=0, shape=tuple(p.shape)) for p in model.parameters())
    return FrozenFacts(name=frozen.name, params=params, sharded_by_fsdp2=frozen.sharded_by_fsdp2,
                       keeps_logits=frozen.keeps_logits)


def _chunk(n: int, parts: int, rank: int) -> int:
    """Elements of ``n`` that ``torch.chunk`` gives to ``rank`` of ``parts`` (FSDP2's and tensor parallelism's
    dim splits)."""
    size = -(-n // parts)
    return max(0, min(size, n - rank * size))


def _gathered_itemsize(p: Param, compute: int | None) -> int:
    return compute if compute and p.cast else p.itemsize
