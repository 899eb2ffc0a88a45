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

HYBRID_SHARD and NO_SHARD are spellings of the data-parallel degrees (:mod:`hfsdp.layout.degrees`): FULL_SHARD or
SHARD_GRAD_OP with ``parallel.dp_replicate_size`` runs as HYBRID_SHARD, with replicas only as NO_SHARD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hfsdp.config.schema import FSDPConfig
from hfsdp.rules.wrapping import precision_parts

if TYPE_CHECKING:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hfsdp.layout.degrees import ParallelDims

# Accelerate's names; the size policy is hfsdp's own (hfsdp.parallel.size_policy.SizeUnits).
_WRAP_POLICIES = {"transformer": "TRANSFORMER_BASED_WRAP", "none": "NO_WRAP"}


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


def build_fsdp_plugin(cfg: FSDPConfig, layer_classes: list[str],
                      dims: "ParallelDims | None" = None) -> "FullyShardedDataParallelPlugin | None":
    """The Accelerate FSDP plugin for ``cfg`` on the run's degrees ``dims``, or None when the strategy runs as DDP
    (FSDP2 NO_SHARD). FSDP1's sharding strategy is the degrees' (:meth:`hfsdp.layout.degrees.ParallelDims.
    fsdp1_strategy`; without ``dims``, the strategy as spelled); FSDP2's mesh comes with them (:mod:`hfsdp.parallel.
    mesh`).

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
        sharding_strategy=(dims.fsdp1_strategy(cfg.sharding_strategy) if dims else cfg.sharding_strategy) if v1
        else None,
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
