"""``--resume`` as one object, :class:`Resume`, through its three phases in run order, and the record a checkpoint
keeps for it (:class:`Record`, ``hfsdp_checkpoint.json``, written by :meth:`Record.of_run` at every save):

1. before anything loads (:meth:`Resume.decide`, asked by ``hfsdp.run.setup.decide``): the checkpoint found, the
   config and the world checked against its record, the config made effective (FSDP kept to read an FSDP
   checkpoint on one process; the accumulation that keeps its global batch on another world size);
2. once the data is read, still before any weight loads (:meth:`Resume.check_data`): the schedule's length and the
   training rows are the checkpoint's;
3. once everything a checkpoint holds is built (:func:`restore`): incomplete saves removed, the checkpoint loaded,
   and the optimizer state proved to be the one that was saved.

Resuming on another number of processes: what must stay the same, and what hfsdp adapts.

A step's data depends only on (seed, step, global batch) (``batches.BatchPlan``), and model and optimizer state are
resharded on load (torch DCP for SHARDED_STATE_DICT, a broadcast of the full tensors for FULL_STATE_DICT). So a
checkpoint resumes on any world size that can keep its global batch (per-device batch x accumulation x ranks):
hfsdp adapts ``train.gradient_accumulation_steps`` when that suffices and otherwise refuses, naming the values that
keep it. The trainer state, LR scheduler and grad scaler are saved once, for all ranks; random numbers in the
loop come from (seed, step, rank) at the start of every step (:func:`seed_step`), not from per-rank RNG files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsdp import __version__
from hfsdp.checkpoint import store
from hfsdp.checkpoint.safe_load import verify_checkpoint
from hfsdp.config.schema import HfsdpConfig
from hfsdp.errors import UserError

if TYPE_CHECKING:
    from hfsdp.hooks.host import PluginHost
    from hfsdp.parallel.world import World

# Keys that may change between a checkpoint and its resume; anything else changes the run and is refused.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.save_every", "train.keep_last",
    "train.export_final", "train.loss_plot", "train.report_to", "train.on_nonfinite", "train.max_consecutive_skips",
    "train.output_dir",
    "train.eval_at_start", "train.max_eval_batches", "train.collective_timeout_s", "train.save_timeout_s",
    "generation_eval",
    "fsdp.single_process",  # how one process runs the same steps; RunSetup keeps FSDP to resume an FSDP checkpoint
    "train.compile", "train.chunked_loss",  # the same steps, computed faster or in less memory
    "train.async_save",  # the same checkpoint, written while training continues
)
# The batch keys may change on resume as long as the global batch they make stays the same.
BATCH_KEYS = ("train.per_device_batch_size", "train.gradient_accumulation_steps")
# The layout: tp_size is checked on its own (Record.tp_size, with its own message), dp_shard_size only checks the world
# size, which may change; out of the fingerprint, checkpoints written before the section existed still resume.
LAYOUT_KEYS = ("parallel",)


@dataclass(frozen=True)
class Record:
    """What a checkpoint records of its run (``hfsdp_checkpoint.json``, written last): what a resume checks and the
    versions that wrote it. A record written by an older hfsdp lacks the later fields (None): a resume does not
    check what it lacks."""

    step: int
    world_size: int
    config_hash: str  # run_fingerprint: the config but for what may change on resume
    global_batch: int | None = None  # per-device batch x accumulation x ranks
    max_steps: int | None = None  # the schedule's length
    train_rows: int | None = None  # the training data (data.batches.identity)
    train_fingerprint: str | None = None
    optimizer: list[dict[str, Any]] | None = None  # optimizer_digest
    tp_size: int | None = None  # parallel.tp_size (None: written before hfsdp had tensor parallelism, i.e. 1)
    state_dict_type: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    plugins: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "Record":
        """The record of the complete checkpoint at ``path`` (a UserError for a folder whose save never completed
        or a damaged record)."""
        data = store.read_record(path)
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{key: value for key, value in data.items() if key in known})
        except TypeError as err:
            raise UserError(f"{path / store.RECORD} is damaged ({err}); resume from or export another "
                            "checkpoint") from None

    @classmethod
    def of_run(cls, config: HfsdpConfig, step: int, world_size: int, plugins: "PluginHost",
               identity: dict[str, Any], optimizer: list[dict[str, Any]]) -> "Record":
        """The record of this run's checkpoint of ``step``. ``identity``: the run's schedule length and training
        data (``max_steps``, ``train_rows``, ``train_fingerprint``); ``optimizer``: :func:`optimizer_digest`."""
        from importlib.metadata import version

        import torch

        return cls(step=step, world_size=world_size, config_hash=run_fingerprint(config),
                   global_batch=global_batch(config, world_size), optimizer=optimizer,
                   state_dict_type=config.fsdp.state_dict_type, tp_size=config.parallel.tp_size,
                   versions={"hfsdp": __version__, "torch": torch.__version__, "accelerate": version("accelerate"),
                             "transformers": version("transformers")},
                   plugins={p.name: p.version for p in plugins.plugins}, **identity)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Resume:
    """The complete checkpoint a ``--resume`` continues from, and its record."""

    path: Path
    record: Record

    @staticmethod
    def decide(config: HfsdpConfig, world: "World", resume: str) -> tuple["Resume | None", HfsdpConfig, list[str]]:
        """Phase 1, before anything loads: the checkpoint ``resume`` names ("latest": the newest complete one in
        ``train.output_dir``; None when there is none yet), checked against ``config`` on ``world``, and the config
        made effective for it, with a note for each change:

        * one process resuming a checkpoint that FSDP saved keeps FSDP (``fsdp.single_process: fsdp``): only FSDP
          reads FSDP's checkpoint layouts;
        * a checkpoint of another world size resumes with the accumulation that keeps its global batch.

        A UserError for a checkpoint this run cannot continue."""
        from hfsdp.rules.wrapping import FSDP_WRAPPERS, wrapper

        path = find_resume_checkpoint(Path(config.train.output_dir), resume)
        if path is None:
            return None, config, []
        by_fsdp = store.saved_by_fsdp(path)
        if world.size == 1 and by_fsdp and config.fsdp.single_process == "auto":
            config = config.model_copy(update={"fsdp": config.fsdp.model_copy(update={"single_process": "fsdp"})})
        record = Record.read(path)
        saved_tp = record.tp_size or 1
        if saved_tp != config.parallel.tp_size:
            raise UserError(f"cannot resume from {path}: it was saved with parallel.tp_size {saved_tp}, this run has "
                            f"{config.parallel.tp_size}; a checkpoint resumes on its own tensor-parallel size (the "
                            "data-parallel ranks may change): resume with parallel.tp_size "
                            f"{saved_tp}, or export it (`hfsdp export`) and start a new run from the folder")
        config, note = keep_global_batch(record, config, world.size, path)
        if wrapper(config.fsdp, world.size) in FSDP_WRAPPERS and not by_fsdp:
            raise UserError(f"cannot resume from {path} under FSDP: one process without a wrapper (or DDP) "
                            "saved it; resume it on one process, or start runs that must resume on other world "
                            "sizes with fsdp.single_process: fsdp")
        check_resume_config(record, config, path)
        return Resume(path, record), config, [note] if note else []

    def check_data(self, identity: dict[str, Any], lr_scheduler: str) -> None:
        """Phase 2, once the data is read (still before any weight loads): the checkpoint continues this run's
        schedule on its data. ``identity``: this run's schedule length and training data, as :class:`Record` keeps
        them (what an older record lacks is not checked)."""
        record, problems = self.record, []
        saved_steps = record.max_steps if record.max_steps is not None else identity["max_steps"]
        if saved_steps != identity["max_steps"] and lr_scheduler != "constant":
            problems.append(f"its {lr_scheduler} LR schedule runs over {saved_steps} steps, this run's over "
                            f"{identity['max_steps']} (train.max_steps/train.epochs changed), so the learning rate "
                            "would jump: resume with the run's length, or use lr_scheduler: constant to extend a run")
        if any(getattr(record, key) is not None and getattr(record, key) != identity[key]
               for key in ("train_rows", "train_fingerprint")):
            problems.append(f"it was trained on other data ({record.train_rows} rows, fingerprint "
                            f"{record.train_fingerprint}; this run's data: {identity['train_rows']} rows, "
                            f"fingerprint {identity['train_fingerprint']}): resume with the data the run started on")
        if problems:
            raise UserError(f"cannot resume from {self.path}: " + "; ".join(problems))


def global_batch(config: HfsdpConfig, world_size: int) -> int:
    """Rows a step trains on: per device x accumulation x the data-parallel ranks (a tensor-parallel group's ranks
    share their rows)."""
    return (config.train.per_device_batch_size * config.train.gradient_accumulation_steps
            * (world_size // config.parallel.tp_size))


def keep_global_batch(record: Record, config: HfsdpConfig, world_size: int,
                      path: Path) -> tuple[HfsdpConfig, str | None]:
    """``config`` unchanged, or with the accumulation that keeps the checkpoint's global batch on ``world_size``
    ranks (and a note saying so); a UserError when no accumulation does."""
    saved_world = record.world_size
    saved = record.global_batch
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
    ranks = world_size // config.parallel.tp_size  # the data-parallel ranks
    per_device, accumulation = config.train.per_device_batch_size, config.train.gradient_accumulation_steps
    if per_device * accumulation * ranks == saved:
        return config, None
    if saved % (per_device * ranks) == 0:
        fitted = saved // (per_device * ranks)
        train = config.train.model_copy(update={"gradient_accumulation_steps": fitted})
        return config.model_copy(update={"train": train}), (
            f"resuming a run of {saved_world} rank(s) on {world_size}: train.gradient_accumulation_steps "
            f"{accumulation} -> {fitted} keeps its global batch of {saved} "
            f"({per_device} per device x {fitted} x {ranks} ranks)")
    choices = [f"per_device_batch_size {p} with gradient_accumulation_steps {saved // ranks // p}"
               for p in range(1, saved // ranks + 1) if saved % ranks == 0 and (saved // ranks) % p == 0]
    fix = (f"set one of: {'; '.join(choices)}" if choices else
           f"{saved} is not a multiple of {ranks}: resume on a number of ranks that divides it")
    raise UserError(f"cannot resume from {path}: its global batch is {saved} samples per step and "
                    f"{per_device} per device x {accumulation} accumulation x {ranks} ranks makes "
                    f"{per_device * accumulation * ranks}; {fix}")


def find_resume_checkpoint(output_dir: Path, resume: str) -> Path | None:
    if resume != "latest":
        path = Path(resume)
        store.read_record(path)  # refuses incomplete folders
        return path
    return store.latest(output_dir / "checkpoints")


def run_fingerprint(config: HfsdpConfig) -> str:
    """What a checkpoint records of its config: the keys that change the run (the batch keys are checked through
    the global batch, :func:`keep_global_batch`)."""
    return config.fingerprint(exclude=RESUMABLE_CHANGES + BATCH_KEYS + LAYOUT_KEYS)


def check_resume_config(record: Record, config: HfsdpConfig, path: Path) -> None:
    """The checkpoint at ``path`` was saved by a run of this config, but for the keys that may change on resume."""
    if record.config_hash != run_fingerprint(config):
        raise UserError(f"cannot resume from {path}: the config changed in keys that change the run (model, data, "
                        f"optimizer, fsdp, batch); only these may change on resume: {', '.join(RESUMABLE_CHANGES)}")


def restore(accelerator, optimizer, point: Resume | None, config: HfsdpConfig, checkpoints: Path, state,
            world) -> None:
    """Phase 3 of ``--resume``, once everything a checkpoint holds is built and registered: remove the saves a
    stopped run left incomplete, then load the checkpoint of ``point`` (``RunSetup.resume``, checked before anything
    loaded; None: no complete checkpoint yet, the run starts from step 0; ``state.step`` tells where) and prove that
    the optimizer state it restored is the one that was saved (:func:`check_optimizer_state`)."""
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
    from hfsdp.rules.wrapping import copies

    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    replicas = copies(config.fsdp, world.size, world.local_size)
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
        digest.append({"lr": float(group["lr"]),
                       "step": [min(lows), max(highs)] if any(math.isfinite(v) for v in lows) else None,
                       "abs_sums": dict(zip(names, sums))})
    return digest


def _holders(value, param, world_size: int, replicas: int) -> int:
    """How many ranks hold each element of an optimizer state ``value``: a DTensor's
    (:func:`hfsdp.parallel.world.element_holders`: sharded as its parameter, or 8-bit moments kept whole,
    :class:`hfsdp.run.optimizers.ShardedAdamW8bit`); every rank for a plain tensor beside a sharded (DTensor)
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
