"""The run's device mesh, the one place meshes are made: from the degrees (:class:`hfsdp.layout.degrees.ParallelDims`),
its dimensions as they declare them (``dp_replicate x dp_shard x sp x tp``: the layout's rank order, torchtitan's and
Accelerate's; ``dp_shard`` as ``efsdp x ep`` where experts are split, as torchtitan's and transformers'), and the
flattened one FSDP shards over, ``dp_shard_cp`` (``dp_shard x sp``: the ranks that hold the same replica, as
torchtitan's ``dp_shard_cp``; Accelerate's FSDP2 preparation reads it by that name). Tensor parallelism splits over
``tp`` (:mod:`hfsdp.parallel.tensor`), sequence parallelism exchanges within ``sp`` (:mod:`hfsdp.parallel.sequence`),
expert parallelism splits each MoE layer's experts over ``ep`` and FSDP2 shards them over ``efsdp``
(:mod:`hfsdp.parallel.expert_parallel`), FSDP2 shards the rest over ``dp_shard_cp`` and replicates over
``dp_replicate`` (:func:`hfsdp.parallel.accelerator.build_accelerator` gives it to Accelerate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hfsdp.layout.degrees import ParallelDims

SHARD = "dp_shard_cp"  # the dimension FSDP shards over (Accelerate's name: its fsdp_dim_names)


def device_mesh(dims: "ParallelDims", device_type: str) -> "DeviceMesh":
    """The mesh of ``dims`` on the launched world (every rank makes it, in the same order, as torch needs): its
    dimensions ``dims.mesh_dims``, and :data:`SHARD` flattened from ``dims.sharded_over``. Ranks r and r+1 of a tp=2 run
    form a tensor-parallel group, ranks r and r+tp hold the same slice of the weights."""
    from torch.distributed.device_mesh import init_device_mesh

    names = dims.mesh_dims
    mesh = init_device_mesh(device_type, tuple(getattr(dims, name) for name in names), mesh_dim_names=names)
    mesh[dims.sharded_over]._flatten(SHARD)
    if dims.ep > 1:  # the data-parallel shard ranks by their name too (Accelerate's data_parallel_shard_rank)
        mesh[("efsdp", "ep")]._flatten("dp_shard")
    return mesh
