"""What wraps the model, decided from the ``fsdp:`` section and the world alone:
the wrapper (none, DDP, FSDP1, FSDP2), the precision parts, HYBRID_SHARD's mesh shape (read into the run's
degrees, :class:`hfsdp.setup.degrees.ParallelDims`), the checks that need the world size, and what CPU rehearsal mode
refuses. Torch-free: validation, ``RunSetup``, ``hfsdp plan`` and ``hfsdp bench`` use these rules;
:mod:`hfsdp.parallel.fsdp` builds torch's and Accelerate's objects from them.
"""

from __future__ import annotations

from typing import Literal, TYPE_CHECKING

from hfsdp.config.schema import FSDPConfig, MixedPrecisionParts


if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


# Shorthands keep the gradient reduction in fp32: summing bf16 gradients across ranks loses precision
# (torchtitan's default); give the parts explicitly to reduce in bf16.
_PRECISION_SHORTHANDS = {
    "bf16": MixedPrecisionParts(param="bfloat16", reduce="float32", buffer="float32"),
    "fp16": MixedPrecisionParts(param="float16", reduce="float32", buffer="float32"),
}


def precision_parts(cfg: FSDPConfig) -> MixedPrecisionParts | None:
    if isinstance(cfg.mixed_precision, MixedPrecisionParts):
        return cfg.mixed_precision
    return _PRECISION_SHORTHANDS.get(cfg.mixed_precision)


# What wraps the model: nothing (one process), DDP (FSDP2's NO_SHARD on several ranks), or FSDP of a version.
Wrapper = Literal["none", "ddp", "fsdp1", "fsdp2"]


FSDP_WRAPPERS = ("fsdp1", "fsdp2")


def wrapper(cfg: FSDPConfig, world_size: int) -> Wrapper:
    """What wraps the model on ``world_size`` ranks: the one rule, decided once per run (``RunSetup.wrapper``) and
    by ``hfsdp plan``/``bench`` for the setups they predict.

    One process has nothing to shard, and a one-rank FSDP still copies every parameter into and out of its
    all-gather buffers, reduce-scatters every gradient and runs the optimizer on DTensors. So one process runs the
    model as it is, unless an option needs FSDP (``cpu_offload``) or ``single_process: fsdp`` asks for it.
    FSDP2 has no NO_SHARD: the seeds define it as DDP, so that is what runs (``FSDPConfig.runs_as_ddp``).
    """
    if cfg.runs_as_ddp:
        return "ddp" if world_size > 1 else "none"
    if world_size > 1 or cfg.cpu_offload or cfg.single_process == "fsdp":
        return "fsdp1" if cfg.version == 1 else "fsdp2"
    return "none"


def hybrid_mesh_shape(cfg: FSDPConfig, world_size: int, local_world_size: int) -> tuple[int, int] | None:
    """(replicate, shard) sizes for HYBRID_SHARD: shard within a node, replicate across nodes."""
    if cfg.sharding_strategy != "HYBRID_SHARD":
        return None
    shard = cfg.hybrid_shard_size or local_world_size
    return world_size // shard, shard


def check_world(cfg: FSDPConfig, world_size: int, local_world_size: int) -> list[tuple[str, str]]:
    """Problems that only show once the world size is known (still before any model is loaded). None where FSDP
    does not wrap the model (one process): a cluster's config still runs a one-process smoke test."""
    shape = hybrid_mesh_shape(cfg, world_size, local_world_size)
    if shape is None or wrapper(cfg, world_size) not in FSDP_WRAPPERS:
        return []
    replicate, shard = shape
    if shard == 1:
        given = "fsdp.hybrid_shard_size is 1" if cfg.hybrid_shard_size else \
            "the default group is the processes per node, 1 here"
        return [("fsdp.hybrid_shard_size", f"HYBRID_SHARD with one rank per shard group shards nothing ({given}): "
                                           "set fsdp.hybrid_shard_size to a divisor of the world size of at least 2, "
                                           "or use NO_SHARD")]
    if replicate * shard != world_size:
        return [("fsdp.hybrid_shard_size", f"{shard} ranks per shard group does not divide the world size {world_size}")]
    if replicate == 1 and cfg.hybrid_shard_size is None:
        return [("fsdp.sharding_strategy", f"HYBRID_SHARD on one node of {world_size} ranks has nothing to replicate "
                                           "across: set fsdp.hybrid_shard_size to a divisor of the world size, "
                                           "or use FULL_SHARD")]
    return []


def buffer_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """A buffer dtype only FSDP1 applies."""
    parts = config.fsdp.mixed_precision
    if (isinstance(parts, MixedPrecisionParts) and "buffer" in parts.model_fields_set and config.fsdp.version == 2
            and parts.buffer != config.model.dtype):
        return [("fsdp.mixed_precision.buffer",
                 f"{parts.buffer}: only FSDP1 casts buffers; FSDP2 (and NO_SHARD under it, which runs as DDP) "
                 f"keeps them in model.dtype ({config.model.dtype}). Remove `buffer`, set it to model.dtype, "
                 "or use fsdp.version 1")]
    return []


def compile_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """``train.compile`` compiles each block, which FSDP1's flat units do not keep apart."""
    if config.train.compile is not None and config.fsdp.version == 1:
        return [("train.compile", "FSDP1 flattens each unit's parameters into one, which hfsdp does not "
                                  "compile per block: use fsdp.version 2, or remove train.compile")]
    return []


# Options that need an accelerator device; rehearsal mode refuses them up front instead of crashing mid-run.
_GPU_ONLY = {
    "fsdp.cpu_offload": lambda c: c.fsdp.cpu_offload,
    "fsdp.version 1 with cpu_ram_efficient_loading": lambda c: c.fsdp.version == 1 and c.fsdp.cpu_ram_efficient_loading,
    "fsdp.version 1 with HYBRID_SHARD": lambda c: c.fsdp.version == 1 and c.fsdp.sharding_strategy == "HYBRID_SHARD",
    # Accelerate's FSDP1 plugin binds sync_module_states to the current CUDA device and raises without one.
    "fsdp.sync_module_states": lambda c: c.fsdp.version == 1 and bool(c.fsdp.sync_module_states),
    "train.compile.mode reduce-overhead / max-autotune (CUDA graphs)":
        lambda c: c.train.compile is not None and c.train.compile.cuda_graphs,
}


def rehearsal_problems(config: HfsdpConfig) -> list[tuple[str, str]]:
    return [
        (option, "needs a GPU; CPU rehearsal mode cannot run it (remove it for the rehearsal)")
        for option, applies in _GPU_ONLY.items() if applies(config)
    ]
