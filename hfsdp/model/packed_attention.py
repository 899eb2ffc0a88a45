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


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (its masks sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sequence_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_sequence_sdpa(model) -> bool:
    """Switch a model that attends with sdpa to :data:`NAME` (True); any other implementation stays (False)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)  # a peft model's: its base model's
    return True
