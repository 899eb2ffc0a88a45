"""The tiled MLP (``train.tiled_mlp``, as axolotl's ``TiledMLP`` and Arctic's): each decoder layer's dense MLP
computed over a micro-batch's positions a tile at a time, each tile checkpointed (its inputs kept, its
intermediates recomputed in the backward, a tile at a time), so a long row's MLP intermediates (the gate, up and
activation outputs, several times the hidden width a position) are never held for the whole row, in the forward or
in the backward's recomputation. A dense MLP computes each position on its own, so the tiles give the untiled
values; the cost is the MLP's forward once more in the backward.

Only where gradients are taken: generation and eval forwards run the MLP as it is. A mixture of experts' MLP (its
router's load-balancing loss sums over all of a micro-batch's tokens) is not tiled (:mod:`hfsdp.rules`).
"""

from __future__ import annotations

from typing import Any

MLP_NAME = "mlp"  # the decoder layers' MLP child in transformers' architectures


def tile_mlps(model, layer_classes: list[str], tokens: int) -> int:
    """Make the ``mlp`` of every module of ``layer_classes`` (the decoder layers) compute ``tokens`` positions at a
    time under autograd; how many it made so."""
    tiled = 0
    for module in model.modules():
        mlp = getattr(module, MLP_NAME, None) if type(module).__name__ in layer_classes else None
        if mlp is not None and not getattr(mlp, "_hfsdp_tiled", False):
            mlp.forward = _tiled(mlp.forward, tokens)
            mlp._hfsdp_tiled = True
            tiled += 1
    return tiled


def _tiled(forward, tokens: int):
    import torch
    from torch.utils.checkpoint import checkpoint

    def tiled(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        positions = x.shape[:-1].numel()
        if args or kwargs or not torch.is_grad_enabled() or positions <= tokens:
            return forward(x, *args, **kwargs)
        flat = x.reshape(positions, x.shape[-1])
        parts = [checkpoint(forward, flat[start:start + tokens], use_reentrant=False)
                 for start in range(0, positions, tokens)]
        return torch.cat(parts).reshape(*x.shape[:-1], parts[0].shape[-1])

    return tiled
