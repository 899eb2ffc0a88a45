"""What ``train.async_save`` needs of the config and the world, checked before any weight loads: background saves
write FSDP2's per-rank shards (SHARDED_STATE_DICT), so a checkpoint that is one file (FULL_STATE_DICT, DDP, one
process without FSDP) cannot be written in the background."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.layout.degrees import ParallelDims


def async_save_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """From the config alone."""
    if not config.train.async_save:
        return []
    problems = []
    if config.fsdp.state_dict_type != "SHARDED_STATE_DICT":
        problems.append(("train.async_save", "writes SHARDED_STATE_DICT checkpoints (per-rank shards) in the "
                                             "background; a FULL_STATE_DICT one is gathered into one file on rank 0: "
                                             "set fsdp.state_dict_type: SHARDED_STATE_DICT, or remove "
                                             "train.async_save"))
    if config.fsdp.version == 1:
        problems.append(("train.async_save", "FSDP1's sharded state dict holds ShardedTensors, which DCP's "
                                             "host-memory staging cannot copy: use fsdp.version 2, or remove "
                                             "train.async_save"))
    if config.fsdp.runs_as_ddp:
        problems.append(("train.async_save", "needs FSDP to shard the model; NO_SHARD under FSDP2 runs as DDP, "
                                             "whose checkpoint is one file: use FULL_SHARD, or remove "
                                             "train.async_save"))
    return problems


def wrapper_problems(config: "HfsdpConfig", dims: "ParallelDims") -> list[tuple[str, str]]:
    """What the degrees wrap the model in, on this world (for the config a resume made effective): one process
    without FSDP, or DDP from degrees that shard nothing, writes one file (NO_SHARD's own refusal is the config's)."""
    if not config.train.async_save or config.fsdp.runs_as_ddp:
        return []
    if dims.wrapper == "none":
        return [("train.async_save", "one process runs the model without FSDP (fsdp.single_process: auto), and its "
                                     "checkpoint is one file: set fsdp.single_process: fsdp, or remove "
                                     "train.async_save")]
    if dims.wrapper == "ddp":
        return [("train.async_save", "the parallel degrees shard nothing (every data-parallel rank a replica), so "
                                     "FSDP2 runs as DDP, whose checkpoint is one file: lower "
                                     "parallel.dp_replicate_size, or remove train.async_save")]
    return []
