"""Resuming on another number of processes: what must stay the same, and what hfsdp adapts.

A step's data depends only on (seed, step, global batch) (``data.BatchPlan``), and model and optimizer state are
resharded on load (torch DCP for SHARDED_STATE_DICT, a broadcast of the full tensors for FULL_STATE_DICT). So a
checkpoint resumes on any world size that can keep its global batch (per-device batch x accumulation x ranks):
hfsdp adapts ``train.gradient_accumulation_steps`` when that suffices and otherwise refuses, naming the values that
keep it. The trainer state, LR scheduler and grad scaler are saved once, for all ranks; random numbers in the
loop come from (seed, step, rank) at the start of every step (:func:`seed_step`), not from per-rank RNG files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfsdp.config import HfsdpConfig
from hfsdp.errors import UserError

# The batch keys may change on resume as long as the global batch they make stays the same.
BATCH_KEYS = ("train.per_device_batch_size", "train.gradient_accumulation_steps")


def global_batch(config: HfsdpConfig, world_size: int) -> int:
    return config.train.per_device_batch_size * config.train.gradient_accumulation_steps * world_size


def keep_global_batch(record: dict[str, Any], config: HfsdpConfig, world_size: int,
                      path: Path) -> tuple[HfsdpConfig, str | None]:
    """``config`` unchanged, or with the accumulation that keeps the checkpoint's global batch on ``world_size``
    ranks (and a note saying so); a UserError when no accumulation does."""
    saved_world = record["world_size"]
    saved = record.get("global_batch")
    if saved is None:  # written before hfsdp recorded it
        if saved_world != world_size:
            raise UserError(f"cannot resume from {path}: it was saved on {saved_world} rank(s), this run has "
                            f"{world_size}, and the checkpoint does not record its global batch; resume with "
                            f"{saved_world} processes")
        return config, None
    if saved_world != world_size and config.fsdp.version == 1:
        raise UserError(f"cannot resume from {path} on {world_size} rank(s): it was saved on {saved_world}, and "
                        "resuming on another world size is supported with fsdp.version 2 only; resume with "
                        f"{saved_world} processes")
    per_device, accumulation = config.train.per_device_batch_size, config.train.gradient_accumulation_steps
    if per_device * accumulation * world_size == saved:
        return config, None
    if saved % (per_device * world_size) == 0:
        fitted = saved // (per_device * world_size)
        train = config.train.model_copy(update={"gradient_accumulation_steps": fitted})
        return config.model_copy(update={"train": train}), (
            f"resuming a run of {saved_world} rank(s) on {world_size}: train.gradient_accumulation_steps "
            f"{accumulation} -> {fitted} keeps its global batch of {saved} "
            f"({per_device} per device x {fitted} x {world_size} ranks)")
    choices = [f"per_device_batch_size {p} with gradient_accumulation_steps {saved // world_size // p}"
               for p in range(1, saved // world_size + 1) if saved % world_size == 0 and (saved // world_size) % p == 0]
    fix = (f"set one of: {'; '.join(choices)}" if choices else
           f"{saved} is not a multiple of {world_size}: resume on a number of ranks that divides it")
    raise UserError(f"cannot resume from {path}: its global batch is {saved} samples per step and "
                    f"{per_device} per device x {accumulation} accumulation x {world_size} ranks makes "
                    f"{per_device * accumulation * world_size}; {fix}")


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed every RNG for optimizer step ``step`` on ``rank``: random numbers (dropout) are then a function of
    (seed, step, rank), identical after a resume on any world size, with no RNG state to carry."""
    import torch

    torch.manual_seed((seed * 1_000_003 + step) * 4_099 + rank)
