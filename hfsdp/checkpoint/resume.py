"""``--resume``'s third phase, once everything a checkpoint holds is built (:func:`restore`): incomplete saves
removed, the checkpoint loaded, and the optimizer state proved to be the one that was saved
(:func:`optimizer_digest`, recorded at every save); and the per-step seeding that makes random numbers a function of
(seed, step, rank) on any world size (:func:`seed_step`). The first two phases, before anything loads, are
:class:`hfsdp.setup.record.Resume`'s.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from hfsdp.checkpoint import store
from hfsdp.checkpoint.safe_load import verify_checkpoint
from hfsdp.config.schema import HfsdpConfig
from hfsdp.errors import UserError
from hfsdp.setup.record import Record, Resume

def restore(accelerator, optimizer, point: Resume | None, config: HfsdpConfig, checkpoints: Path, state,
            world, loading: Callable[[Record], ContextManager[None]] = lambda record: contextlib.nullcontext()) -> None:
    """Phase 3 of ``--resume``, once everything a checkpoint holds is built and registered: remove the saves a
    stopped run left incomplete, then load the checkpoint of ``point`` (``RunSetup.resume``, checked before anything
    loaded; None: no complete checkpoint yet, the run starts from step 0; ``state.step`` tells where) inside
    ``loading(record)`` (what the optimizer does around a load: schedule-free's training weights) and prove that the
    optimizer state it restored is the one that was saved (:func:`check_optimizer_state`)."""
    say = accelerator.print
    if accelerator.is_main_process:  # folders of saves killed midway (kill -9, node loss) are never used: remove them
        for stale in store.remove_incomplete(checkpoints):
            say(f"removed {stale.name}, an incomplete checkpoint a stopped run left behind")
    if point is None:
        say(f"--resume: no complete checkpoint in {checkpoints}; starting from step 0")
        return
    path, record = point.path, point.record
    verify_checkpoint(path)  # every file Accelerate/DCP would unpickle: plain data only
    # A sharded optimizer state loads into the state the optimizer already has (FSDP1's DCP path builds its load
    # target from it): an optimizer that has not stepped yet has none, and would silently keep none. Its state is
    # created first by a step with zero gradients and learning rate 0, as torch's own get_optimizer_state_dict does.
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(getattr(optimizer, "optimizer", optimizer))
    with stateless_left_out(getattr(optimizer, "optimizer", optimizer), record.optimizer), loading(record):
        accelerator.load_state(str(path))
    check_optimizer_state(record, optimizer_digest(accelerator, optimizer, config, world), path)
    say(f"resumed from {path} at step {state.step}")


# Relative tolerance of the optimizer-state sums: the same float32 values summed in float64 in another order (another
# world size shards them differently) agree to ~1e-12; a lost or mixed-up state is off by orders of magnitude.
DIGEST_REL = 1e-6


def optimizer_digest(accelerator, optimizer, config: HfsdpConfig, world) -> list[dict[str, Any]]:
    """What a checkpoint records of the optimizer state, the same on every rank and for every world size the
    checkpoint can resume on: per parameter group its learning rate, the lowest and highest step count, and for each
    tensor state (Adam's moments) the sum of absolute values over the whole model, each element counted once however
    the ranks shard or replicate it. Collective: every rank calls it."""
    import math

    import torch

    from hfsdp.parallel.world import all_sum, gather_objects, local_tensor, per_rank

    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    replicas = world.dims.replicas
    digest = []
    for group in torch_optimizer.param_groups:
        held = [(p, torch_optimizer.state[p]) for p in group["params"] if torch_optimizer.state.get(p)]
        states = [st for _, st in held]
        # a rank whose shard holds no element of a group's parameters has no state for them: agree on the names
        here = {name for st in states for name, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        names = sorted(set().union(*gather_objects(accelerator, here)))
        sums = all_sum(accelerator, [sum(float(local_tensor(st[name]).double().abs().sum())
                                         / _holders(st[name], p, world.size, replicas) for p, st in held if name in st)
                                     for name in names])
        steps = [float(st["step"]) for st in states if "step" in st]
        lows = per_rank(accelerator, min(steps) if steps else math.inf)
        highs = per_rank(accelerator, max(steps) if steps else -math.inf)
        # trainable parameters no rank has a state for: none has had a gradient yet (a vision-language model's
        # projector on rows without images); a resume leaves them so (see restore)
        unused = {i for i, p in enumerate(group["params"]) if p.requires_grad and not torch_optimizer.state.get(p)}
        unused = sorted(set.intersection(*gather_objects(accelerator, unused)))
        digest.append({"lr": float(group["lr"]),
                       "step": [min(lows), max(highs)] if any(math.isfinite(v) for v in lows) else None,
                       "abs_sums": dict(zip(names, sums)), **({STATELESS: unused} if unused else {})})
    return digest


# The digest's key for the positions (in their group) of the parameters that had no optimizer state when it was saved.
STATELESS = "without_state"


@contextlib.contextmanager
def stateless_left_out(optimizer, saved: list[dict[str, Any]] | None) -> Iterator[None]:
    """Around a load: the parameters a checkpoint saved no optimizer state for (its digest's :data:`STATELESS`)
    without the state the load target made for them and, while it loads, out of what it restores (torch looks for
    the state of every parameter that requires a gradient: "Missing key in checkpoint state_dict"). The run that
    saved it had none for them: their first gradient makes it, as it would have there."""
    params = [group["params"][i] for group, before in zip(optimizer.param_groups, saved or ())
              for i in before.get(STATELESS, ())]
    for p in params:
        optimizer.state.pop(p, None)
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _holders(value, param, world_size: int, replicas: int) -> int:
    """How many ranks hold each element of an optimizer state ``value``: a DTensor's
    (:func:`hfsdp.parallel.world.element_holders`: sharded as its parameter, or 8-bit moments kept whole,
    :class:`hfsdp.run.sharded.adamw_8bit.ShardedAdamW8bit`); every rank for a plain tensor beside a sharded (DTensor)
    parameter (bitsandbytes' quantization maps); else the replicas of the parameter (FSDP1's flat shards, DDP, one
    process)."""
    from torch.distributed.tensor import DTensor

    from hfsdp.parallel.world import element_holders

    if isinstance(value, DTensor):
        return element_holders(value, world_size)
    return world_size if isinstance(param, DTensor) else replicas


def check_optimizer_state(record: Record, restored: list[dict[str, Any]], path: Path) -> None:
    """Refuse to train on an optimizer state that is not the one the checkpoint saved (records written before hfsdp
    recorded it are not checked): a silent divergence after resume is worse than a stop."""
    import math

    saved = record.optimizer
    if saved is None:
        return
    problems = []
    if len(saved) != len(restored):
        problems.append(f"{len(saved)} parameter groups saved, {len(restored)} restored")
    for i, (before, after) in enumerate(zip(saved, restored)):
        if before["step"] != after["step"]:
            problems.append(f"group {i}: step counts {before['step']} saved, {after['step']} restored")
        if not math.isclose(before["lr"], after["lr"], rel_tol=DIGEST_REL):
            problems.append(f"group {i}: learning rate {before['lr']} saved, {after['lr']} restored")
        for name in sorted(set(before["abs_sums"]) | set(after["abs_sums"])):
            a, b = before["abs_sums"].get(name), after["abs_sums"].get(name)
            if a is None or b is None or not math.isclose(a, b, rel_tol=DIGEST_REL, abs_tol=1e-30):
                problems.append(f"group {i}: {name} sums to {a} saved, {b} restored")
    if problems:
        raise UserError(f"the optimizer state restored from {path} is not the one that was saved ("
                        + "; ".join(problems[:4]) + (f"; {len(problems) - 4} more" if len(problems) > 4 else "")
                        + "): training from it would silently diverge, so hfsdp stops. Resume with the torch and "
                        "Accelerate versions that wrote it (hfsdp_checkpoint.json 'versions'), or report it")


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed every RNG for optimizer step ``step`` on ``rank``: random numbers (dropout) are then a function of
    (seed, step, rank), identical after a resume on any world size, with no RNG state to carry."""
    import torch

    torch.manual_seed((seed * 1_000_003 + step) * 4_099 + rank)
