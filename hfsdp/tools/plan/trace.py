"""Step 2 of ``hfsdp plan``: one forward and the training loss of a micro-batch on the meta device, with a
saved-tensors hook that records every tensor autograd keeps for the backward pass (see
:func:`trace_activations`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hfsdp.config.schema import HfsdpConfig
from hfsdp.model.loading import accepts_logits_to_keep, build_meta_model, layer_classes
from hfsdp.setup.decide import one_process
from hfsdp.tools.plan.estimate import compute_dtype
from hfsdp.tools.plan.facts import Activations, Images


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


def _meta_autocast(autocast):
    """``torch.autocast`` that takes the meta device for the CPU: peft's adapters of fused expert weights (LoRA's
    ``target_parameters``) open ``torch.autocast(device_type=<the weight's>, enabled=False)``, which torch refuses
    for the meta device the trace runs on; disabled, it changes nothing."""

    class MetaAutocast(autocast):
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    return MetaAutocast


def _meta_grouped_mm(grouped_mm):
    """``torch.nn.functional.grouped_mm`` that takes float32 on the meta device: torch 2.13's meta kernel asks for
    bfloat16 (its CUDA kernel's), though its CPU kernel, which transformers' grouped experts run on CPU, takes
    float32. The result has the real op's shape and dtype, and autograd saves what the real op saves: its two
    inputs (the weight, a parameter, is not counted). The trace runs no backward."""
    import torch

    class MetaGroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, mat_a, mat_b, offs):
            ctx.save_for_backward(mat_a, mat_b)
            return grouped_mm(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), offs=offs).to(mat_a.dtype)

    def patched(mat_a, mat_b, *args, offs=None, **kwargs):
        if mat_a.device.type != "meta" or mat_a.dtype == torch.bfloat16 or args or kwargs:
            return grouped_mm(mat_a, mat_b, *args, offs=offs, **kwargs)
        return MetaGroupedMM.apply(mat_a, mat_b, offs)

    return patched


class _Tower:
    """A vision-language model's vision tower and projector traced on fake tensors (torch's ``FakeTensorMode``:
    shapes, no memory), where the rest of the plan's trace runs on the meta device: the towers read their images'
    layout (Qwen's ``image_grid_thw``, Idefics3's padding images and masks) as values, which the meta device does not
    have. The layout and the pixel values are given as real values (fake tensors keep small tensors' values,
    "constants", through the operations that read them), but for Qwen's, whose values it does not read (fake: an
    image's patches can be many)."""

    CONSTANT_ELEMENTS = 1 << 24  # the largest tensor whose value the fake tensors keep (two images' pixel values)

    def __init__(self, model):
        import inspect

        import torch
        from torch._subclasses import fake_tensor

        from hfsdp.model.vision import part_roots

        self.model, self.torch, self.fake = model, torch, fake_tensor
        self.mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        modules = dict(model.named_modules())
        roots = [n for names in part_roots(model).values() for n in names]
        with self.mode:  # the tower's and projector's parameters and buffers as fake tensors on the CPU
            for name in roots:
                if not any(name.startswith(f"{outer}.") for outer in roots):  # (Qwen's projector is in its tower)
                    modules[name].to_empty(device="cpu")
        self.vision = model.config.vision_config
        self.takes = set(inspect.signature(model.get_image_features).parameters)

    def _constant(self, tensor):
        return self.mode.fake_tensor_converter.from_real_tensor(self.mode, tensor, make_constant=True)

    def _window_index(self, real):
        """transformers' ``get_vision_window_index`` (Qwen2.5-VL's window attention) computed on the real layout:
        it builds its indices with ``torch.arange``, which fake tensors do not keep the values of."""
        def computed(grid_thw, *args, **kwargs):
            with self.fake.unset_fake_temporarily():
                out = real(grid_thw.constant if isinstance(grid_thw, self.fake.FakeTensor) else grid_thw,
                           *args, **kwargs)
            return tuple(self._constant(t) for t in out)

        return computed

    def inputs(self, tokens: int, count: int) -> dict:
        """``count`` images' inputs to ``get_image_features``: a tower that takes images of any size (Qwen's,
        ``image_grid_thw``) gets images of ``tokens`` image tokens (what it saves grows with the patches, however
        they are split into images); a tower of a fixed size (``vision_config.image_size``) images of that size."""
        torch, vision = self.torch, self.vision
        if "image_grid_thw" in self.takes:
            merge = vision.spatial_merge_size
            high = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)  # the squarest layout
            grid = torch.tensor([[1, high * merge, tokens // high * merge]] * count)
            width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
            with self.mode:
                pixels = torch.empty(count * tokens * merge * merge, width)
            return {"pixel_values": pixels, "image_grid_thw": self._constant(grid)}
        size, channels = vision.image_size, getattr(vision, "num_channels", 3)
        if "pixel_attention_mask" in self.takes:  # Idefics3's rows of images (all-zero ones are padding), and masks
            return {"pixel_values": self._constant(torch.ones(1, count, channels, size, size)),
                    "pixel_attention_mask": self._constant(torch.ones(1, count, size, size, dtype=torch.long))}
        return {"pixel_values": self._constant(torch.ones(count, channels, size, size))}

    def run(self, tokens: int, count: int) -> int:
        """Run the tower and projector on ``count`` images (:meth:`inputs`); the image tokens each makes."""
        import contextlib
        import sys
        from unittest import mock

        from transformers import vision_utils

        real = vision_utils.get_vision_window_index
        patched = [mock.patch.object(module, "get_vision_window_index", self._window_index(real))
                   for name, module in list(sys.modules.items())
                   if name.startswith("transformers.models.") and getattr(module, "get_vision_window_index", None) is real]
        kwargs = self.inputs(tokens, count)
        with contextlib.ExitStack() as stack, self.mode:
            stack.enter_context(mock.patch.object(self.fake, "CONSTANT_NUMEL_LIMIT", self.CONSTANT_ELEMENTS))
            for patch in patched:
                stack.enter_context(patch)
            features = self.model.get_image_features(**kwargs).pooler_output
            parts = features if isinstance(features, (list, tuple)) else [features]
            return sum(p.numel() for p in parts) // parts[0].shape[-1] // count


@dataclass(frozen=True)
class MicroBatchShape:
    """The micro-batch ``hfsdp plan`` traces: ``rows`` of ``width`` tokens, with logits at the last ``positions`` of
    each; ``packing``: what the plan assumed of packed rows (None: not packed)."""

    rows: int
    width: int
    positions: int
    packing: str | None = None

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def micro_batch_shape(config: HfsdpConfig, host, objective=None, sp: int = 1) -> MicroBatchShape:
    """The training micro-batch at its largest, as ``hfsdp plan`` traces it; with ``sp > 1`` (sequence parallel) a
    rank's share of it: ``1/sp`` of each row's positions (rounded up), every one with logits (a split micro-batch
    keeps them all), as :class:`hfsdp.parallel.sequence.SequenceSplit` makes it. Whole, it is

    * one sequence a row: ``train.per_device_batch_size`` x a plugin ``objective``'s ``sequences_per_row`` rows of
      ``data.max_seq_len`` tokens; an objective that samples completions: its rows that much longer, with logits at
      the completions' positions only (its rows align them at the end);
    * rows packed before training (hook ``hfsdp_packed_row_tokens``; the packing plugin's ``scope: dataset``): as
      many rows, each as long as a packed row (``packing.max_len``);
    * packed micro-batches (hook ``hfsdp_pack_micro_batches``; ``scope: micro_batch``): the tokens of the unpacked
      micro-batch (every sequence at its longest) laid end to end in rows as wide as a packed row, or as the
      longest item if longer (a pair's two sequences, a row and its KL row, a prompt and its completion, which
      share a row): ``ceil(tokens / width)`` rows of ``width``, the last padded to it as collation pads it, with
      logits at every position (a completion may lie anywhere in a row). The activations that grow with the tokens
      are then those of the unpacked micro-batch (plus the last row's padding); eager attention, whose scores are
      ``width`` x ``width`` a row, costs more than one sequence a row. (A mix of lengths that best-fit decreasing
      leaves in more, part-filled rows of that width can exceed this: at most a row per item.)"""
    whole = _whole_micro_batch_shape(config, host, objective)
    if sp == 1:
        return whole
    local = -(-whole.width // sp)
    return MicroBatchShape(whole.rows, local, local, (f"{whole.packing}; " if whole.packing else "")
                           + f"1/{sp} of each row's {whole.width} positions on each rank, sequence parallel")


def _whole_micro_batch_shape(config: HfsdpConfig, host, objective=None) -> MicroBatchShape:
    from hfsdp.objective import TokenCrossEntropy, micro_batch_packing

    batch, seq = config.train.per_device_batch_size, config.data.max_seq_len
    per_row = objective.sequences_per_row if objective is not None else 1
    sampling = objective.sampling() if objective is not None else None
    seq += sampling.new_tokens if sampling is not None else 0
    pack_len = micro_batch_packing(host, config, objective or TokenCrossEntropy())
    if pack_len is not None:
        item = per_row * seq
        width = max(pack_len, item) if pack_len else batch * item  # no limit: at most one row of all
        rows = -(-batch * item // width)
        return MicroBatchShape(rows, width, width, f"packed micro-batches: {batch * per_row} sequences of up to "
                                                   f"{seq} tokens laid end to end in rows of up to {width} tokens")
    packed = [n for _, n in host.call("hfsdp_packed_row_tokens", config=config) if n is not None]
    if packed:
        width = max(max(packed), seq)
        return MicroBatchShape(batch * per_row, width, width, f"packed rows of up to {width} tokens")
    return MicroBatchShape(batch * per_row, seq, sampling.new_tokens if sampling is not None else seq)


def trace_activations(model_config, config: HfsdpConfig, host, precision: str, objective=None,
                      sp: int = 1, image_tokens: int = 0) -> Activations:
    """Saved tensors of one training micro-batch (:func:`micro_batch_shape`; a sequence-parallel rank's share of it
    with ``sp > 1``: each rank attends with ``heads / sp`` heads over whole rows, which saves as many elements as all
    heads over its share of the positions) in the compute dtype of ``precision``.
    Only the default objective runs the chunked loss (``train.chunked_loss``); a plugin's computes the full
    logits. A vision-language model's rows carry ``image_tokens`` image tokens each (tokens of the row, traced with
    the rest): the vision tower and projector run on the images they come from (:class:`_Tower`: one image traced
    and two, what one saves counted and what a further one adds for each further image; a tower of a fixed image size
    takes as many whole images as make at most ``image_tokens``, at least one), and what they save is counted with
    the layers'."""
    import contextlib
    from unittest import mock

    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from hfsdp.model.token_loss import token_loss_sum

    shape = micro_batch_shape(config, host, objective, sp)
    # logits at every position, or (an objective that samples) at the completions' only, where its rows align them
    batch, seq, positions = shape.rows, shape.width, shape.positions
    chunked = config.train.chunked_loss and objective is None
    model = build_meta_model(model_config, one_process(config), host, compute_dtype(config, precision))
    model.train()
    if not accepts_logits_to_keep(model):
        positions = seq
    classes = set(layer_classes(config.fsdp, model_config))
    params = {id(p) for p in model.parameters()}
    current: list[int | None] = [None]
    # each pass's (the text's; one image's, then two images', through the tower) saved tensors: id(storage owner) -> (layer,
    # bytes), the tensors its layers take (id -> bytes) and what each layer called takes anew
    passes: list[_Pass] = [_Pass()]
    keep: list[Any] = []  # saved tensors stay alive, so ids are not reused during the trace

    def pack(t):
        base, saved = t._base if t._base is not None else t, passes[-1].saved
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
            fresh, inputs = 0, passes[-1].inputs
            for t in tensors:
                if id(t) not in inputs:
                    inputs[id(t)] = t.numel() * t.element_size()
                    keep.append(t)
                    fresh += inputs[id(t)]
            passes[-1].layer_inputs.append(fresh)

        def post(module, args, output):
            current[0] = None

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post))
    patch = contextlib.ExitStack()
    if config.model.attn_implementation != "eager":
        patch.enter_context(mock.patch.object(F, "scaled_dot_product_attention", _fused_sdpa()))
    patch.enter_context(mock.patch.object(torch, "autocast", _meta_autocast(torch.autocast)))
    if hasattr(F, "grouped_mm"):
        patch.enter_context(mock.patch.object(F, "grouped_mm", _meta_grouped_mm(F.grouped_mm)))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    head = model.get_output_embeddings()
    lm_head = head is not None  # else a sequence-classification model (plugin reward_model): one score per token
    outputs = model_config.get_text_config().vocab_size if lm_head else getattr(model.config, "num_labels", 1)
    # What the plain loss saves after the model's forward (train.chunked_loss keeps none of it).
    hooks.append(model.register_forward_hook(lambda module, args, output: current.__setitem__(0, "loss")))
    try:
        with patch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # The plain loss itself, on a batch of rows without padding. use_cache left on: an empty cache holds only
            # the keys and values backward saves anyway (training turns it off); off, transformers looks for packed
            # rows with a .item() that meta tensors cannot answer.
            if lm_head:
                kept = {"logits_to_keep": positions} if positions < seq else {}
                loss = token_loss_sum(model, SimpleNamespace(inputs={"input_ids": ids, **kept},
                                                             targets=ids[:, seq - positions:]))
            else:  # a head without a vocabulary (a reward model's score): its outputs summed
                loss = model(input_ids=ids).logits.float().sum()
            del loss
            if image_tokens:  # then one image, and two, through the vision tower (its parameters fake tensors now)
                text = passes[0].tally(len(layers))
                keep.clear()  # (the parameters among the saved tensors: a parameter referred to is not converted)
                tower = _Tower(model)
                params = {id(p) for p in model.parameters()}
                for count in (1, 2):
                    current[0] = None
                    passes.append(_Pass())
                    made = tower.run(image_tokens, count)
    finally:
        for h in hooks:
            h.remove()
    per_layer, outside, loss_saved = text if image_tokens else passes[0].tally(len(layers))
    layer_inputs, images = passes[0].layer_inputs, None
    if image_tokens:  # the micro-batch's images: what one saves, and what each further one adds (not what they share)
        copies = batch * max(1, image_tokens // made)
        (one, outside_one, _), (two, outside_two, _) = passes[1].tally(len(layers)), passes[2].tally(len(layers))
        more = lambda a, b: a + (copies - 1) * (b - a)  # noqa: E731
        in_tower = [more(a, b) for a, b in zip(one, two)]
        per_layer = [n + m for n, m in zip(per_layer, in_tower)]
        outside += more(outside_one, outside_two)
        layer_inputs += [more(a, b) for a, b in zip(passes[1].layer_inputs, passes[2].layer_inputs)]
        images = Images(count=copies, tokens=made, saved=sum(in_tower) + more(outside_one, outside_two))
    from hfsdp.model.token_loss import LOSS_CHUNK_ELEMENTS, tied_input_embedding

    vocab, chunks = model_config.get_text_config().vocab_size, {}
    if chunked and lm_head:  # the chunked loss's chunks of float32 logits, and the head's gradient it makes
        per_chunk = min(max(1, LOSS_CHUNK_ELEMENTS // vocab), batch * seq)
        count = -(-batch * seq // per_chunk)
        chunks = {"chunk_bytes": per_chunk * vocab * 4, "chunk_count": count,
                  "last_chunk_bytes": (batch * seq - (count - 1) * per_chunk) * vocab * 4,
                  "head_grad_bytes": sum(p.numel() * p.element_size() for p in head.parameters() if p.requires_grad),
                  "one_tied_gradient": tied_input_embedding(model) is not None}
    return Activations(outside_layers=outside, per_layer=tuple(per_layer), layer_inputs=tuple(layer_inputs),
                       logits_bytes=batch * positions * outputs * 4, loss_saved=loss_saved, tokens=batch * seq,
                       images=images, **chunks)


@dataclass
class _Pass:
    """One forward's record in :func:`trace_activations`: the tensors saved for the backward (id of the storage's
    owner -> the layer that saved it, or None outside the layers, or "loss"; and its bytes), the tensors the layers
    take (id -> bytes: one passed to several layers, like the rotary tables, counted once) and what each layer call
    takes anew."""

    saved: dict[int, tuple[Any, int]] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    layer_inputs: list[int] = field(default_factory=list)

    def tally(self, layers: int) -> tuple[list[int], int, int]:
        """The saved bytes by where they were saved: each layer's, outside the layers, and the plain loss's."""
        per_layer = [0] * layers
        outside = loss_saved = 0
        for layer, nbytes in self.saved.values():
            if layer is None:
                outside += nbytes
            elif layer == "loss":
                loss_saved += nbytes
            else:
                per_layer[layer] += nbytes
        return per_layer, outside, loss_saved
