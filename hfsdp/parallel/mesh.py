"""The run's device mesh, the one place meshes are made: from the degrees (:class:`hfsdp.layout.degrees.ParallelDims`),
its dimensions ``dp_replicate x dp_shard x sp x tp`` in that order (the layout's rank order, torchtitan's and
Accelerate's), and the flattened one FSDP shards over, ``dp_shard_cp`` (``dp_shard x sp``: the ranks that hold the
same replica, as torchtitan's ``dp_shard_cp``; Accelerate's FSDP2 preparation reads it by that name). Tensor
parallelism splits over ``tp`` (:mod:`hfsdp.parallel.tensor`), sequence parallelism exchanges within ``sp``
(:mod:`hfsdp.parallel.sequence`), FSDP2 shards over ``dp_shard_cp`` and replicates over ``dp_replicate``
(:func:`hfsdp.parallel.accelerator.build_accelerator` gives it to Accelerate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hfsdp.layout.degrees import ParallelDims

DIMS = ("dp_replicate", "dp_shard", "sp", "tp")
SHARD = "dp_shard_cp"  # FSDP's shard dimension, dp_shard x sp (Accelerate's name: its fsdp_dim_names)


def needs_mesh(dims: "ParallelDims") -> bool:
    """Whether the degrees split the world in groups (tensor- or sequence-parallel ones, or HSDP's replicas); where
    they do not, FSDP and DDP use the whole world's group, as torch does by default."""
    return dims.tp > 1 or dims.sp > 1 or dims.hybrid


def device_mesh(dims: "ParallelDims", device_type: str) -> "DeviceMesh":
    """The mesh of ``dims`` on the launched world (every rank makes it, in the same order, as torch needs): ranks r
    and r+1 of a tp=2 run form a tensor-parallel group, ranks r and r+tp hold the same slice of the weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(getattr(dims, name) for name in DIMS), mesh_dim_names=DIMS)
    mesh[("dp_shard", "sp")]._flatten(SHARD)
    return mesh
