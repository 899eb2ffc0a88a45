"""What ``train.async_save`` needs of the config and the world, checked before any weight loads: background saves
write FSDP2's per-rank shards (SHARDED_STATE_DICT), so a checkpoint that is one file (FULL_STATE_DICT, DDP, one
process without FSDP) cannot be written in the background."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfsdp.rules.wrapping import wrapper

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


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


def single_process_problems(config: "HfsdpConfig", world_size: int) -> list[tuple[str, str]]:
    """One process that runs the model without FSDP (what :func:`hfsdp.rules.wrapping.wrapper` decides on this
    world, for the config a resume made effective)."""
    if config.train.async_save and wrapper(config.fsdp, world_size) == "none" and not config.fsdp.runs_as_ddp:
        return [("train.async_save", "one process runs the model without FSDP (fsdp.single_process: auto), and its "
                                     "checkpoint is one file: set fsdp.single_process: fsdp, or remove "
                                     "train.async_save")]
    return []
