"""Tensor parallelism with torch's own pieces: the 2-D device mesh (``dp_shard_cp`` x ``tp``, tensor-parallel ranks
consecutive, as torchtitan and Accelerate order them) and the architecture's plan (:func:`hfsdp.rules.parallel.tp_plan`)
applied to the decoder layers by ``parallelize_module``, before FSDP2 shards over the data-parallel dimension.

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

    from hfsdp.setup.degrees import World

# Mesh dimension names: Accelerate's, so that its FSDP2 preparation finds its data-parallel mesh (fsdp_dim_names).
DP_DIM, TP_DIM = "dp_shard_cp", "tp"


def device_mesh(world: "World", device_type: str) -> "DeviceMesh":
    """The (data-parallel, tensor-parallel) mesh of ``world``: ranks r and r+1 of a tp=2 run form a tensor-parallel
    group, ranks r and r+tp hold the same slice and split the rows."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world.dims.dp_size, world.dims.tp), mesh_dim_names=(DP_DIM, TP_DIM))


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
    torch_tp.parallelize_module(base, mesh[TP_DIM], plan, src_data_rank=None)
