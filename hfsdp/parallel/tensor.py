"""Tensor parallelism with torch's own pieces: the run's device mesh (:func:`hfsdp.parallel.mesh.device_mesh`,
tensor-parallel ranks consecutive, as torchtitan and Accelerate order them) and the architecture's plan
(:func:`hfsdp.rules.parallel.tp_plan`) applied to the decoder layers by ``parallelize_module`` over its ``tp``
dimension, before FSDP2 shards over its data-parallel one.

hfsdp applies the plan itself rather than through ``from_pretrained(tp_plan=...)`` and Accelerate's
``ParallelismConfig(tp_size=...)``: on Accelerate 1.16 with transformers 5.24 the latter imports a transformers class
that no longer exists (``ReplicateParallel``) when it composes TP with FSDP2, and transformers' loading path replaces
a given mesh by one of the whole world. Every rank loads the same weights and keeps its own slice of them
(``src_data_rank=None``: no scatter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfsdp.rules.parallel import TP_STYLES, tp_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def parallelize(model, mesh: "DeviceMesh") -> None:
    """Split the decoder layers of ``model`` (a causal LM) over ``mesh[tp]`` by its architecture's plan, in place.
    The plan's styles are checked before any weight loads (:func:`hfsdp.rules.parallel.model_problems`)."""
    import logging

    from torch.distributed.tensor import parallel as torch_tp

    # Gathering a column-split weight that FSDP2 also shards (_StridedShard) takes two all-gathers, which torch warns
    # about on every rank at each full state dict (export, FULL_STATE_DICT checkpoints): expected here, not a fault.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "base_model", base)  # the plan's paths start at the base model (LlamaModel)
    plan = {path: getattr(torch_tp, TP_STYLES[style])() for path, style in tp_plan(model.config).items()}
    torch_tp.parallelize_module(base, mesh["tp"], plan, src_data_rank=None)
