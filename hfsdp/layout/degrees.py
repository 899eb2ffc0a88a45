"""The parallel degrees of a run in one value (:class:`ParallelDims`, as torchtitan's), and where a process is in the
job (:class:`World`, what the launcher started). Torch-free.

Every degree is a key of the ``parallel:`` section (``dp_replicate_size``, ``dp_shard_size`` with -1 for the rest,
``cp_size``, ``sp_size``, ``tp_size``, ``ep_size``); ``fsdp.sharding_strategy`` HYBRID_SHARD (with
``fsdp.hybrid_shard_size``) and NO_SHARD are accepted spellings of the data-parallel degrees, and FULL_SHARD /
SHARD_GRAD_OP say only whether FSDP frees the gathered parameters after the forward. :meth:`ParallelDims.of` derives
the degrees and the wrapper they make from the config and the world once; :meth:`ParallelDims.problems` says what the
launched world does not allow of them; the one device-mesh builder (:func:`hfsdp.parallel.mesh.device_mesh`) makes
every mesh from them.

Ranks are laid out as ``dp_replicate x dp_shard x cp x sp x tp``, the tensor-parallel ranks innermost (consecutive
ranks, inside a node): a data-parallel rank is ``rank // (cp * sp * tp)``; the ranks of a ring and of a
sequence-parallel group split each row's tokens, rank ``rank // tp % (cp * sp)`` holding that share of them in order.
Expert parallelism splits the data-parallel shard ranks (``dp_shard = efsdp x ep``, as torchtitan's and transformers'
``efsdp``): the ``ep`` consecutive ranks of a group train on their own rows and hold 1/ep of every MoE layer's experts
each; FSDP2 shards the experts over the ``efsdp`` ranks that hold the same ones, everything else over all of
``dp_shard``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from hfsdp.config.schema import FSDPConfig, HfsdpConfig, ParallelConfig


# What wraps the model: nothing (one process), DDP (FSDP2 sharding nothing on several ranks), or FSDP of a version.
Wrapper = Literal["none", "ddp", "fsdp1", "fsdp2"]
FSDP_WRAPPERS = ("fsdp1", "fsdp2")
# The degrees a strategy name spells by itself; the others leave them to the parallel section.
SPELLING_STRATEGIES = ("HYBRID_SHARD", "NO_SHARD")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run (their product is the world size) and the wrapper they make.

    * ``dp_replicate``: copies of the model's state across data-parallel ranks (HYBRID's replica groups, every rank
      where nothing is sharded: DDP, NO_SHARD, one process);
    * ``dp_shard``: the ranks FSDP shards each parameter over within a replica (1 where nothing is sharded);
    * ``cp``: the ranks of a ring (context parallel), which train on the same rows, each on its share of every row's
      tokens, attending over the others' keys and values as they pass around the ring (FSDP shards over them too);
    * ``sp``: the ranks of a sequence-parallel group, which train on the same rows, each on its share of every row's
      tokens (FSDP shards over them too: a parameter over ``dp_shard x cp x sp`` ranks, as torchtitan's
      ``dp_shard_cp``);
    * ``tp``: the ranks of a tensor-parallel group, which split each layer's matrices and train on the same rows;
    * ``ep``: the ranks of an expert-parallel group, a split of ``dp_shard`` (so they train on their own rows), which
      hold 1/ep of each MoE layer's experts each;
    * ``wrapper``: what wraps the model (:meth:`of` says the rule);
    * ``world_size``, ``local_world_size``: the launched job, which :meth:`problems` holds the degrees against.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    wrapper: Wrapper = "none"
    world_size: int = 1
    local_world_size: int = 1

    # The mesh's dimensions, outermost first (the rank order); the data-parallel ones (the rest train on the same
    # rows: groups of consecutive ranks inside a node, each the parallel section's ``<name>_size``); those that split
    # each row's tokens (FSDP shards over them too, flattened with dp_shard: torchtitan's dp_shard_cp). The mesh
    # (hfsdp.parallel.mesh), the groups' checks and the products below are read off them.
    MESH: ClassVar[tuple[str, ...]] = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
    DATA_PARALLEL: ClassVar[tuple[str, ...]] = ("dp_replicate", "dp_shard")
    TOKEN_SPLIT: ClassVar[tuple[str, ...]] = ("cp", "sp")
    # Why a group of each dimension stays inside a node.
    INSIDE: ClassVar[dict[str, str]] = {
        "cp": "ring (context-parallel group) must stay inside one node (it passes every layer's keys and values "
              "around)",
        "sp": "sequence-parallel group must stay inside one node (it exchanges every layer's attention inputs and "
              "outputs)",
        "tp": "tensor-parallel group must stay inside one node (it all-reduces in every layer)",
        "ep": "expert-parallel group must stay inside one node (it exchanges every MoE layer's tokens twice)",
    }

    @classmethod
    def groups(cls) -> tuple[str, ...]:
        """The dimensions whose ranks train on the same rows (all but the data-parallel ones), outermost first."""
        return tuple(name for name in cls.MESH if name not in cls.DATA_PARALLEL)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The device mesh's dimensions, outermost first: :attr:`MESH`, ``dp_shard`` split as ``efsdp x ep`` where
        experts are split."""
        if self.ep == 1:
            return self.MESH
        at = self.MESH.index("dp_shard")
        return (*self.MESH[:at], "efsdp", "ep", *self.MESH[at + 1:])

    @property
    def efsdp(self) -> int:
        """The ranks FSDP shards each expert over: those of a replica holding the same experts."""
        return self.dp_shard // self.ep

    @property
    def sharded_over(self) -> tuple[str, ...]:
        """The dimensions FSDP shards each parameter over (flattened into one: the mesh's ``dp_shard_cp``)."""
        return (*(("efsdp", "ep") if self.ep > 1 else ("dp_shard",)), *self.TOKEN_SPLIT)

    def product(self, names: tuple[str, ...]) -> int:
        return math.prod(getattr(self, name) for name in names)

    @classmethod
    def of(cls, fsdp: "FSDPConfig", parallel: "ParallelConfig", world_size: int, local_world_size: int,
           resumes_fsdp: bool = False) -> "ParallelDims":
        """The degrees the ``fsdp`` and ``parallel`` sections ask of ``world_size`` ranks (``local_world_size`` per
        node), and the wrapper:

        * one process runs the model as it is (one FSDP rank still copies every parameter into and out of its
          all-gather buffers, reduce-scatters every gradient and runs the optimizer on DTensors), unless an option
          needs FSDP (``fsdp.cpu_offload``), ``fsdp.single_process: fsdp`` asks for it, or it resumes a checkpoint
          FSDP saved (``resumes_fsdp``: only FSDP reads its layouts);
        * FSDP2 sharding nothing (every data-parallel rank a replica, no sequence or tensor groups) is DDP, as the
          seeds define NO_SHARD; FSDP1 has a NO_SHARD of its own;
        * otherwise FSDP of ``fsdp.version``.

        Arithmetic only: :meth:`problems` says whether the world allows them."""
        sizes = {name: getattr(parallel, f"{name}_size") for name in cls.groups()}
        data_parallel = max(1, world_size // math.prod(sizes.values()))  # (a world too small: a problem said apart)
        asks_fsdp = fsdp.cpu_offload or fsdp.single_process == "fsdp" or resumes_fsdp
        if fsdp.sharding_strategy == "HYBRID_SHARD" and (world_size > 1 or asks_fsdp):
            shard = fsdp.hybrid_shard_size or local_world_size  # (on one FSDP rank: a problem said)
            replicate = max(1, data_parallel // shard)
        elif world_size == 1:
            replicate, shard = 1, 1
        elif fsdp.sharding_strategy == "NO_SHARD":
            replicate, shard = data_parallel, 1
        else:
            replicate = parallel.dp_replicate_size
            shard = parallel.dp_shard_size if parallel.dp_shard_size > 0 else max(1, data_parallel // replicate)
        # (HYBRID_SHARD's groups of one rank shard nothing too: a problem said, not DDP)
        shards_nothing = shard * math.prod(sizes.values()) == 1 and fsdp.sharding_strategy != "HYBRID_SHARD" and (
            world_size > 1 or fsdp.sharding_strategy == "NO_SHARD")
        if fsdp.version == 2 and shards_nothing:
            wrapper = "ddp" if world_size > 1 else "none"
        elif world_size > 1 or asks_fsdp:
            wrapper = "fsdp1" if fsdp.version == 1 else "fsdp2"
        else:
            wrapper = "none"
        return cls(dp_replicate=replicate, dp_shard=shard, ep=parallel.ep_size, wrapper=wrapper,
                   world_size=world_size, local_world_size=local_world_size, **sizes)

    @property
    def fsdp(self) -> bool:
        """FSDP (version 1 or 2) wraps the model."""
        return self.wrapper in FSDP_WRAPPERS

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: what the global batch is split over."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: the ranks of a tensor- or sequence-parallel group train on the
        same rows."""
        return rank // self.row_copies

    @property
    def token_split(self) -> int:
        """The shares each row's tokens are split in (a ring's ranks times a sequence-parallel group's)."""
        return self.product(self.TOKEN_SPLIT)

    def token_share(self, rank: int) -> int:
        """Which share of each row's tokens global ``rank`` holds, in the row's order (0 where rows are not split):
        a sequence-parallel group holds consecutive shares, the ring's groups one after another."""
        return rank // self.tp % self.token_split

    def sp_rank(self, rank: int) -> int:
        """Global ``rank``'s rank in its sequence-parallel group."""
        return rank // self.tp % self.sp

    def cp_rank(self, rank: int) -> int:
        """Global ``rank``'s rank in its ring."""
        return rank // (self.tp * self.sp) % self.cp

    @property
    def row_copies(self) -> int:
        """The ranks that hold each row of the global batch (a tensor- or sequence-parallel group's): sums over all
        ranks of what each row has (its tokens) count it this many times."""
        return self.product(self.groups())

    @property
    def shard_group(self) -> int:
        """The ranks FSDP shards each parameter over: a replica's data-parallel ranks and their sequence-parallel
        ranks (which hold the same parameters: FSDP shards over them too, as torchtitan's ``dp_shard_cp``)."""
        return self.product(self.sharded_over)

    @property
    def splits_groups(self) -> bool:
        """The degrees split the world in groups (tensor- or sequence-parallel ones, or HSDP's replicas): the run
        needs a device mesh (:mod:`hfsdp.parallel.mesh`); without, FSDP and DDP use the whole world's group."""
        return self.row_copies > 1 or self.hybrid or self.ep > 1

    @property
    def hybrid(self) -> bool:
        """FSDP shards within groups of ranks and replicates across them (HSDP: FSDP2's 2-D mesh, FSDP1's
        HYBRID_SHARD)."""
        return self.fsdp and self.dp_replicate > 1 and self.shard_group > 1

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients FSDP (or DDP) averages: the data-parallel ranks, and in each the ranks of a
        sequence-parallel group, whose losses each cover part of their rows' tokens (a tensor-parallel group's ranks
        compute the same loss, and FSDP2 reduces over the data-parallel dimension only)."""
        return self.dp_size * self.product(self.TOKEN_SPLIT)

    @property
    def replicas(self) -> int:
        """How many ranks hold each element of a parameter that no tensor-parallel split divides (and of its
        gradient and optimizer state): the data-parallel copies."""
        return self.dp_replicate

    def fsdp1_strategy(self, spelled: str) -> str:
        """FSDP1's sharding strategy for these degrees, ``spelled`` being ``fsdp.sharding_strategy``: HYBRID_SHARD
        where they shard and replicate, NO_SHARD where they only replicate, else the spelled one."""
        if self.hybrid:
            return "HYBRID_SHARD"
        if self.dp_replicate > 1 and self.shard_group * self.row_copies == 1:
            return "NO_SHARD"
        return spelled

    def problems(self, config: "HfsdpConfig") -> list[tuple[str, str]]:
        """What the launched world does not allow of these degrees, each with the key that asked for it: the
        sequence- and tensor-parallel groups divide the world and stay inside a node, the given data-parallel sizes
        make the world, HYBRID_SHARD's groups shard and replicate. None where no wrapper runs (one process): a
        cluster's config still runs a one-process smoke test."""
        parallel, fsdp = config.parallel, config.fsdp
        for name in self.groups():
            if problems := _group_problems(f"{name}_size", getattr(self, name), self.world_size,
                                           self.local_world_size, self.INSIDE[name]):
                return problems
        inner = self.row_copies
        if self.world_size % inner:  # each group divides the world, their product not
            named = " x ".join(f"{name}_size {getattr(self, name)}" for name in self.groups() if getattr(self, name) > 1)
            return [(f"parallel.{next(n for n in self.groups() if getattr(self, n) > 1)}_size",
                     f"{named} is {inner} ranks a group, which does not divide the world size {self.world_size}: "
                     f"launch a multiple of {inner} processes, or change them")]
        data_parallel = self.world_size // inner
        if data_parallel % parallel.dp_replicate_size:
            return [("parallel.dp_replicate_size",
                     f"{parallel.dp_replicate_size} does not divide the {data_parallel} data-parallel ranks (the world "
                     f"size {self.world_size}" + (f" / {inner}, the sequence- and tensor-parallel ranks)" if inner > 1
                                                  else ")") + ": launch a multiple of it, or change it")]
        if parallel.dp_shard_size > 0 and parallel.dp_shard_size * parallel.dp_replicate_size * inner != self.world_size:
            named = [f"{key} {value}" for key, value in (("dp_replicate_size", parallel.dp_replicate_size),
                                                         *((f"{n}_size", getattr(self, n)) for n in self.groups()))
                     if value > 1]
            others = parallel.dp_replicate_size * inner
            return [("parallel.dp_shard_size", f"{parallel.dp_shard_size} x {' x '.join(named)} is "
                                               f"{parallel.dp_shard_size * others}, not the world size "
                                               f"{self.world_size}: set it to {self.world_size // others}, or remove "
                                               "it") if named else
                    ("parallel.dp_shard_size", f"{parallel.dp_shard_size} is not the world size {self.world_size}: "
                                               "remove it (FSDP shards over every rank), or set "
                                               "parallel.dp_replicate_size to replicate across groups")]
        if fsdp.sharding_strategy == "HYBRID_SHARD" and self.fsdp:
            if problems := _hybrid_problems(fsdp.hybrid_shard_size, self.dp_replicate, self.dp_shard, self.world_size):
                return problems
        return self._expert_problems(config) if self.ep > 1 else []

    def _expert_problems(self, config: "HfsdpConfig") -> list[tuple[str, str]]:
        """Expert parallelism splits FSDP2's shard ranks of each replica, in groups inside a node (what the config
        and the model must allow: :mod:`hfsdp.rules.parallel`)."""
        if self.dp_shard % self.ep or self.dp_shard == 1:
            return [("parallel.ep_size", f"{self.ep} does not divide the {self.dp_shard} ranks FSDP shards over in each replica "
                          f"(the world size {self.world_size}" + (f" / parallel.dp_replicate_size {self.dp_replicate}"
                                                                 if self.dp_replicate > 1 else "")
                     + "): the expert-parallel groups are a split of them; launch a multiple of it, or change it")]
        return _group_problems("ep_size", self.ep, self.world_size, self.local_world_size, self.INSIDE["ep"])


def _group_problems(key: str, size: int, world_size: int, local_world_size: int,
                    inside: str) -> list[tuple[str, str]]:
    """A group of ``size`` consecutive ranks (``parallel.<key>``) in the world: ``size`` divides the world size,
    and the processes per node (``inside``: why a group must not span nodes)."""
    if size == 1:
        return []
    if world_size % size:
        return [(f"parallel.{key}", f"{size} does not divide the world size {world_size}: launch a multiple of "
                                    f"{size} processes, or change parallel.{key}")]
    if local_world_size % size:
        return [(f"parallel.{key}", f"{size} does not divide the {local_world_size} processes per node: a {inside}")]
    return []


def _hybrid_problems(given: int | None, replicate: int, shard: int, world_size: int) -> list[tuple[str, str]]:
    """HYBRID_SHARD's groups (``shard`` ranks each, ``fsdp.hybrid_shard_size`` if ``given``, else the processes per
    node) shard something, make the world, and are replicated."""
    if shard == 1:
        said = "fsdp.hybrid_shard_size is 1" if given else "the default group is the processes per node, 1 here"
        return [("fsdp.hybrid_shard_size", f"HYBRID_SHARD with one rank per shard group shards nothing ({said}): "
                                           "set fsdp.hybrid_shard_size to a divisor of the world size of at least 2, "
                                           "or use NO_SHARD")]
    if replicate * shard != world_size:
        return [("fsdp.hybrid_shard_size", f"{shard} ranks per shard group does not divide the world size {world_size}")]
    if replicate == 1 and given is None:
        return [("fsdp.sharding_strategy", f"HYBRID_SHARD on one node of {world_size} ranks has nothing to replicate "
                                           "across: set fsdp.hybrid_shard_size to a divisor of the world size, "
                                           "or use FULL_SHARD")]
    return []


@dataclass(frozen=True)
class World:
    """Where this process is in the job, as the launcher started it, and the run's degrees (:class:`ParallelDims`;
    one data-parallel rank per process and no wrapper until :meth:`with_dims` derives them from the config)."""

    rank: int
    size: int
    local_size: int
    on_cpu: bool
    dims: ParallelDims | None = None  # None: one data-parallel rank per process (set in __post_init__)

    def __post_init__(self):
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims(dp_replicate=self.size, world_size=self.size,
                                                          local_world_size=self.local_size))

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (the ranks of a tensor- or sequence-parallel group train on the same
        rows)."""
        return self.dims.dp_rank(self.rank)

    def with_dims(self, config: "HfsdpConfig", resumes_fsdp: bool = False) -> "World":
        """This world with the degrees ``config`` asks of it (:meth:`ParallelDims.of`)."""
        return replace(self, dims=ParallelDims.of(config.fsdp, config.parallel, self.size, self.local_size,
                                                  resumes_fsdp=resumes_fsdp))
