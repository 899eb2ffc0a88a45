"""Where a process is in the job (:class:`World`, what the launcher started) and the run's parallel degrees in one
value (:class:`ParallelDims`, as torchtitan's), derived once from the config and the world by
:func:`hfsdp.setup.decide.decide` and validated here (:func:`problems`). The device meshes, the batch plan's
data-parallel rank and size, the checkpoint record's global batch, the step's reductions, the gradient norm and
``hfsdp plan`` all read the degrees from it. Torch-free.

Ranks are laid out as ``dp_replicate x dp_shard x sp x tp``, the tensor-parallel ranks innermost (consecutive
ranks, inside a node): a data-parallel rank is ``rank // (sp * tp)``, a sequence-parallel rank ``rank // tp % sp``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hfsdp.rules import parallel
from hfsdp.rules.wrapping import FSDP_WRAPPERS, check_world, hybrid_mesh_shape, wrapper

if TYPE_CHECKING:
    from hfsdp.config.schema import FSDPConfig, HfsdpConfig


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run: their product is the world size.

    * ``dp_replicate``: copies of the model's state across data-parallel ranks (HYBRID_SHARD's replica groups, every
      rank under NO_SHARD or DDP, 1 where FSDP shards over all data-parallel ranks or one process runs);
    * ``dp_shard``: the ranks FSDP shards each parameter over within a replica (1 where nothing is sharded);
    * ``sp``: the ranks of a sequence-parallel group, which train on the same rows, each on its share of every row's
      tokens (FSDP shards over them too: a parameter over ``dp_shard x sp`` ranks, as torchtitan's ``dp_shard_cp``);
    * ``tp``: the ranks of a tensor-parallel group, which split each layer's matrices and train on the same rows.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, fsdp: "FSDPConfig", tp: int, world_size: int, local_world_size: int, sp: int = 1) -> "ParallelDims":
        """The degrees of ``world_size`` ranks (``local_world_size`` per node) under the ``fsdp:`` section and the
        tensor- and sequence-parallel sizes (arithmetic only: :func:`problems` says whether the world allows them)."""
        data_parallel = max(1, world_size // (tp * sp))  # (a world too small for the groups: a problem said apart)
        if wrapper(fsdp, world_size) not in FSDP_WRAPPERS or fsdp.sharding_strategy == "NO_SHARD":
            return cls(dp_replicate=data_parallel, dp_shard=1, sp=sp, tp=tp)
        shape = hybrid_mesh_shape(fsdp, world_size, local_world_size)
        if shape is not None:
            return cls(dp_replicate=shape[0], dp_shard=shape[1], sp=sp, tp=tp)
        return cls(dp_replicate=1, dp_shard=data_parallel, sp=sp, tp=tp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp * self.tp

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: what the global batch is split over."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: the ranks of a tensor- or sequence-parallel group train on the
        same rows."""
        return rank // (self.sp * self.tp)

    def sp_rank(self, rank: int) -> int:
        """Which share of each row's tokens global ``rank`` holds (0 where sequences are not split)."""
        return rank // self.tp % self.sp

    @property
    def row_copies(self) -> int:
        """The ranks that hold each row of the global batch (a tensor- or sequence-parallel group's): sums over all
        ranks of what each row has (its tokens) count it this many times."""
        return self.tp * self.sp

    @property
    def shard_group(self) -> int:
        """The ranks FSDP shards each parameter over: a replica's data-parallel ranks and their sequence-parallel
        ranks (which hold the same parameters: FSDP shards over them too, as torchtitan's ``dp_shard_cp``)."""
        return self.dp_shard * self.sp

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients FSDP (or DDP) averages: the data-parallel ranks, and in each the ranks of a
        sequence-parallel group, whose losses each cover part of their rows' tokens (a tensor-parallel group's ranks
        compute the same loss, and FSDP2 reduces over the data-parallel dimension only)."""
        return self.dp_size * self.sp

    @property
    def replicas(self) -> int:
        """How many ranks hold each element of a parameter that no tensor-parallel split divides (and of its
        gradient and optimizer state): the data-parallel copies."""
        return self.dp_replicate


def problems(config: "HfsdpConfig", world_size: int, local_world_size: int) -> list[tuple[str, str]]:
    """What the launched world must allow of the degrees the config asks: HYBRID_SHARD's groups
    (:func:`hfsdp.rules.wrapping.check_world`) and the tensor-parallel groups (:func:`hfsdp.rules.parallel.
    world_problems`)."""
    return (check_world(config.fsdp, world_size, local_world_size)
            + parallel.world_problems(config, world_size, local_world_size))


@dataclass(frozen=True)
class World:
    """Where this process is in the job, as the launcher started it, and the run's degrees (:class:`ParallelDims`;
    one data-parallel rank per process until :func:`hfsdp.setup.decide.decide` derives them from the config)."""

    rank: int
    size: int
    local_size: int
    on_cpu: bool
    dims: ParallelDims | None = None  # None: one data-parallel rank per process (set in __post_init__)

    def __post_init__(self):
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims(dp_replicate=self.size))

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (the ranks of a tensor- or sequence-parallel group train on the same
        rows)."""
        return self.dims.dp_rank(self.rank)

    def with_dims(self, config: "HfsdpConfig") -> "World":
        """This world with the degrees ``config`` asks of it."""
        return replace(self, dims=ParallelDims.of(config.fsdp, config.parallel.tp_size, self.size, self.local_size,
                                                  sp=config.parallel.sp_size))
