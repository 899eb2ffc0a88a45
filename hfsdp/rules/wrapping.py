"""The rules of the ``fsdp:`` section beside the degrees: the precision parts, what FSDP1 and FSDP2 each apply
(buffers, compiled blocks), and what CPU rehearsal mode refuses. What wraps the model (none, DDP, FSDP1, FSDP2) is
the degrees' answer (:class:`hfsdp.layout.degrees.ParallelDims`). Torch-free: validation, the decided run, ``hfsdp
plan`` and ``hfsdp bench`` use these rules; :mod:`hfsdp.parallel.fsdp` builds torch's and Accelerate's objects from
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfsdp.config.schema import FSDPConfig, HfsdpConfig, MixedPrecisionParts

if TYPE_CHECKING:
    from hfsdp.layout.degrees import ParallelDims


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


def tiled_mlp_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """``train.tiled_mlp`` checkpoints tiles inside each block, which compiled blocks have not been tried with."""
    if config.train.tiled_mlp is not None and config.train.compile is not None:
        return [("train.tiled_mlp", "compiled blocks with checkpointed MLP tiles inside are not tried yet: remove "
                                    "train.compile or train.tiled_mlp")]
    return []


def tiled_mlp_model_problems(config: "HfsdpConfig", model_config: Any) -> list[tuple[str, str]]:
    """A mixture of experts' MLP is not tiled: its router's load-balancing loss sums over all of a micro-batch's
    tokens."""
    from hfsdp.rules.experts import experts_of

    if config.train.tiled_mlp is not None and experts_of(model_config) is not None:
        return [("train.tiled_mlp", f"{model_config.model_type} is a mixture of experts, whose MLP (its router and "
                                    "experts) is not tiled: remove train.tiled_mlp")]
    return []


# Options that need an accelerator device; rehearsal mode refuses them up front instead of crashing mid-run. Each
# reads the config and the run's degrees.
_GPU_ONLY = {
    "fsdp.cpu_offload": lambda c, d: c.fsdp.cpu_offload,
    "fsdp.version 1 with cpu_ram_efficient_loading":
        lambda c, d: c.fsdp.version == 1 and c.fsdp.cpu_ram_efficient_loading,
    # by name, or by the degrees (replicas of shard groups: parallel.dp_replicate_size)
    "fsdp.version 1 with HYBRID_SHARD":
        lambda c, d: c.fsdp.version == 1 and (c.fsdp.sharding_strategy == "HYBRID_SHARD" or d.hybrid),
    # Accelerate's FSDP1 plugin binds sync_module_states to the current CUDA device and raises without one.
    "fsdp.sync_module_states": lambda c, d: c.fsdp.version == 1 and bool(c.fsdp.sync_module_states),
    "train.compile.mode reduce-overhead / max-autotune (CUDA graphs)":
        lambda c, d: c.train.compile is not None and c.train.compile.cuda_graphs,
}


def rehearsal_problems(config: HfsdpConfig, dims: "ParallelDims") -> list[tuple[str, str]]:
    """What CPU rehearsal cannot run of ``config`` on the degrees ``dims``."""
    return [
        (option, "needs a GPU; CPU rehearsal mode cannot run it (remove it for the rehearsal)")
        for option, applies in _GPU_ONLY.items() if applies(config, dims)
    ]
