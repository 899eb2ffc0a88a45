"""Attention over packed rows, one sequence at a time: transformers' sdpa attention, registered as
:data:`NAME`, that, given the rows' sequences (the model input :data:`hfsdp.data.layout.SEGMENTS`, which a packed
micro-batch carries), runs each sequence's causal attention on its own instead of the row's whole square under a
block-diagonal mask.

A packed row of ``n`` sequences of length ``L`` costs under a mask ``(nL)^2`` scores, of which ``n L^2`` count; on a
CPU the masked kernel also materializes them. Run one sequence at a time, a packed micro-batch costs in attention
what its sequences cost one per row, and packing only removes padding (what flash attention's variable-length
kernels give on a GPU, which transformers derives from ``position_ids``). The values are sdpa's on each sequence
alone, which the block-diagonal mask gives too: the same log-probs. Without :data:`SEGMENTS` (generation, the packing
probe, an unpacked micro-batch) it is sdpa as transformers runs it.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from hfsdp.data.layout import SEGMENTS

NAME = "hfsdp_sdpa"


def sequence_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward``, each packed sequence's own where the call carries
    :data:`SEGMENTS` (``query``/``key``/``value``: ``[rows, heads, width, head_dim]``; the output ``[rows, width,
    heads, head_dim]``, zero at padding, which no labelled position reads)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS, None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for r, spans in enumerate(segments):
        parts = [sdpa_attention_forward(module, query[r:r + 1, :, a:b], key[r:r + 1, :, a:b], value[r:r + 1, :, a:b],
                                        None, is_causal=True, **kwargs)[0] for a, b in spans]
        used = spans[-1][1] if spans else 0
        if used < query.size(2):
            parts.append(query.new_zeros(1, query.size(2) - used, query.size(1), value.size(-1)))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


# Whether the forward running now carries what its attention reads instead of a mask (set by :func:`read_spans`'s
# hooks around the model's forward; a context variable, so that threads as ranks each have theirs).
_READS_SPANS: ContextVar[bool] = ContextVar("hfsdp_reads_spans", default=False)


def span_aware_mask(*args, **kwargs):
    """sdpa's mask (transformers' ``sdpa_mask``), or none in a forward whose inputs carry the rows' spans, which the
    attention reads instead (:func:`read_spans`): from position ids that restart, transformers would otherwise build
    a rows x width x width block-diagonal mask, O(width^2) for each row, that the attention ignores."""
    from transformers.masking_utils import sdpa_mask

    return None if _READS_SPANS.get() else sdpa_mask(*args, **kwargs)


def read_spans(model, keys: tuple[str, ...]) -> None:
    """Around each forward of ``model`` (a peft model's base model's), note whether its inputs carry one of ``keys``
    (:data:`SEGMENTS`, or a sequence-parallel split's), for :func:`span_aware_mask`; the note is undone after the
    forward, also when it raises. The hooks are added once per model; a later call adds its keys."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    watched = getattr(base, "_hfsdp_span_keys", None)
    if watched is not None:
        watched.update(keys)
        return
    watched = base._hfsdp_span_keys = set(keys)
    tokens: list = []

    def before(module, args, kwargs):
        tokens.append(_READS_SPANS.set(any(key in kwargs for key in watched)))

    def after(module, args, kwargs, output):
        if tokens:
            _READS_SPANS.reset(tokens.pop())

    base.register_forward_pre_hook(before, with_kwargs=True)
    base.register_forward_hook(after, with_kwargs=True, always_call=True)


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (its masks sdpa's, none where the forward
    carries the spans: :func:`span_aware_mask`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sequence_sdpa)
    AttentionMaskInterface.register(NAME, span_aware_mask)


def use_sequence_sdpa(model) -> bool:
    """Switch a model that attends with sdpa to :data:`NAME` (True); any other implementation stays (False)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)  # a peft model's: its base model's
    read_spans(model, (SEGMENTS,))
    return True
