"""Pure builders from the ``fsdp:`` config section to Accelerate objects.

Every field of ``FullyShardedDataParallelPlugin`` is set here, because Accelerate fills the fields left unset from
``FSDP_*`` environment variables: the YAML must be the only source of FSDP settings.

Strategy mapping (the seeds' definitions):

=============  ==========================================  =============================================
strategy       FSDP1 (FullyShardedDataParallel)            FSDP2 (fully_shard)
=============  ==========================================  =============================================
FULL_SHARD     ShardingStrategy.FULL_SHARD (ZeRO-3)         reshard_after_forward=True
SHARD_GRAD_OP  ShardingStrategy.SHARD_GRAD_OP (ZeRO-2)      reshard_after_forward=False
HYBRID_SHARD   ShardingStrategy.HYBRID_SHARD                2-D mesh (replicate × shard), reshard=True
NO_SHARD       ShardingStrategy.NO_SHARD                    plain DDP (no FSDP plugin)
=============  ==========================================  =============================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from hfsdp.config.schema import FSDPConfig, MixedPrecisionParts

if TYPE_CHECKING:
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

# Shorthands keep the gradient reduction in fp32: summing bf16 gradients across ranks loses precision
# (torchtitan's default); give the parts explicitly to reduce in bf16.
_PRECISION_SHORTHANDS = {
    "bf16": MixedPrecisionParts(param="bfloat16", reduce="float32", buffer="float32"),
    "fp16": MixedPrecisionParts(param="float16", reduce="float32", buffer="float32"),
}
# Accelerate's names; the size policy is hfsdp's own (hfsdp.parallel.size_policy.SizeUnits).
_WRAP_POLICIES = {"transformer": "TRANSFORMER_BASED_WRAP", "none": "NO_WRAP"}


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


def _mixed_precision_policy(cfg: FSDPConfig):
    parts = precision_parts(cfg)
    if parts is None:
        return None
    if cfg.version == 1:
        from torch.distributed.fsdp import MixedPrecision

        return MixedPrecision(
            param_dtype=getattr(torch, parts.param), reduce_dtype=getattr(torch, parts.reduce),
            buffer_dtype=getattr(torch, parts.buffer),
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # FSDP2 leaves buffers in their loaded dtype, so `buffer` only applies to FSDP1.
    return MixedPrecisionPolicy(param_dtype=getattr(torch, parts.param), reduce_dtype=getattr(torch, parts.reduce))


def _backward_prefetch(cfg: FSDPConfig) -> str:
    if cfg.version != 1 or cfg.backward_prefetch == "NONE":
        return "NO_PREFETCH"
    return cfg.backward_prefetch or "BACKWARD_PRE"


def build_fsdp_plugin(cfg: FSDPConfig, layer_classes: list[str]) -> "FullyShardedDataParallelPlugin | None":
    """The Accelerate FSDP plugin for ``cfg``, or None when the strategy runs as DDP (FSDP2 NO_SHARD).

    ``layer_classes`` are the transformer block class names to wrap (``cfg.transformer_layer_cls`` or the
    model's ``_no_split_modules``); ignored by the size and none policies. The size policy is a
    :class:`hfsdp.parallel.size_policy.SizeUnits` (Accelerate's own cannot run FSDP2 or tied embeddings).
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    if cfg.runs_as_ddp:
        return None
    v1 = cfg.version == 1
    # Ranks > 0 hold empty weights only under cpu_ram_efficient_loading; only then is a broadcast needed.
    sync_module_states = cfg.sync_module_states if cfg.sync_module_states is not None else cfg.cpu_ram_efficient_loading
    policy = _mixed_precision_policy(cfg)
    if cfg.wrap_policy == "size":
        from hfsdp.parallel.size_policy import SizeUnits

        wrap = SizeUnits(cfg.min_num_params)
    else:
        wrap = _WRAP_POLICIES[cfg.wrap_policy]
    return FullyShardedDataParallelPlugin(
        fsdp_version=cfg.version,
        sharding_strategy=cfg.sharding_strategy if v1 else None,
        reshard_after_forward=None if v1 else cfg.sharding_strategy != "SHARD_GRAD_OP",
        # "NO_PREFETCH" (not None, which Accelerate would fill from FSDP_BACKWARD_PREFETCH) means "none".
        backward_prefetch=_backward_prefetch(cfg),
        mixed_precision_policy=policy,
        auto_wrap_policy=wrap,
        transformer_cls_names_to_wrap=list(layer_classes) if cfg.wrap_policy == "transformer" else None,
        min_num_params=cfg.min_num_params if cfg.wrap_policy == "size" else None,
        cpu_offload=cfg.cpu_offload,
        ignored_modules=[],
        state_dict_type=cfg.state_dict_type,
        limit_all_gathers=(cfg.limit_all_gathers if cfg.limit_all_gathers is not None else True) if v1 else True,
        # FSDP1 needs original parameters for frozen/trainable mixes (LoRA) and per-parameter optimizer groups.
        use_orig_params=(cfg.use_orig_params if cfg.use_orig_params is not None else True) if v1 else None,
        sync_module_states=sync_module_states if v1 else None,
        forward_prefetch=bool(cfg.forward_prefetch) if v1 else None,
        activation_checkpointing=cfg.activation_checkpointing,
        activation_checkpointing_offload=False,
        cpu_ram_efficient_loading=cfg.cpu_ram_efficient_loading,
    )


def hybrid_mesh_shape(cfg: FSDPConfig, world_size: int, local_world_size: int) -> tuple[int, int] | None:
    """(replicate, shard) sizes for HYBRID_SHARD: shard within a node, replicate across nodes."""
    if cfg.sharding_strategy != "HYBRID_SHARD":
        return None
    shard = cfg.hybrid_shard_size or local_world_size
    return world_size // shard, shard


def copies(cfg: FSDPConfig, world_size: int, local_world_size: int) -> int:
    """How many ranks hold each element of a parameter (and of its gradient and optimizer state): one where FSDP
    shards over all ranks, the replica groups under HYBRID_SHARD, every rank under NO_SHARD, DDP or one process."""
    if wrapper(cfg, world_size) not in FSDP_WRAPPERS or cfg.sharding_strategy == "NO_SHARD":
        return world_size
    shape = hybrid_mesh_shape(cfg, world_size, local_world_size)
    return shape[0] if shape else 1


def build_parallelism_config(cfg: FSDPConfig, world_size: int, local_world_size: int) -> "ParallelismConfig | None":
    """Accelerate's 2-D data-parallel mesh for HYBRID_SHARD; None for the other strategies."""
    shape = hybrid_mesh_shape(cfg, world_size, local_world_size)
    if shape is None:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    replicate, shard = shape
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)


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
