"""A checkpoint as the decided run sees it, before anything loads: the folder layout (complete checkpoints, the
latest, the record read back), what a checkpoint records of its run (:class:`Record`, ``hfsdp_checkpoint.json``,
written by :meth:`Record.of_run` at every save) and the first two phases of ``--resume`` (:class:`Resume`):

1. before anything loads (:meth:`Resume.decide`, asked by :func:`hfsdp.setup.decide.decide`): the checkpoint found,
   the config and the world checked against its record, the config made effective (FSDP kept to read an FSDP
   checkpoint on one process; the accumulation that keeps its global batch on another world size);
2. once the data is read, still before any weight loads (:meth:`Resume.check_data`): the schedule's length and the
   training rows are the checkpoint's.

The third, loading the checkpoint once everything it holds is built, is :func:`hfsdp.checkpoint.resume.restore`.
Torch-free.

Resuming on another number of processes: what must stay the same, and what hfsdp adapts.

A step's data depends only on (seed, step, global batch) (``batches.BatchPlan``), and model and optimizer state are
resharded on load (torch DCP for SHARDED_STATE_DICT, a broadcast of the full tensors for FULL_STATE_DICT). So a
checkpoint resumes on any world size that can keep its global batch (per-device batch x accumulation x the
data-parallel ranks): hfsdp adapts ``train.gradient_accumulation_steps`` when that suffices and otherwise refuses,
naming the values that keep it. The trainer state, LR scheduler and grad scaler are saved once, for all ranks;
random numbers in the loop come from (seed, step, rank) at the start of every step
(:func:`hfsdp.checkpoint.resume.seed_step`), not from per-rank RNG files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsdp import __version__
from hfsdp.config.schema import HfsdpConfig
from hfsdp.disk.durable import EXPORT_RECORD, RECORD
from hfsdp.errors import UserError
from hfsdp.rules.wrapping import FSDP_WRAPPERS, wrapper

if TYPE_CHECKING:
    from hfsdp.hooks.host import PluginHost
    from hfsdp.setup.degrees import ParallelDims, World

CONFIG_NAME = "hfsdp_config.yaml"
PREFIX = "step-"


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{PREFIX}{step}"


def complete_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    found = []
    if checkpoints.is_dir():
        for path in checkpoints.iterdir():
            if path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit() and (path / RECORD).is_file():
                found.append((int(path.name[len(PREFIX):]), path))
    return sorted(found)


def latest(checkpoints: Path) -> Path | None:
    complete = complete_checkpoints(checkpoints)
    return complete[-1][1] if complete else None


def _what_it_is(path: Path) -> str:
    """The likely mix-up behind a folder given as a checkpoint that is not one."""
    for kind, folder in (("a run folder", path / "checkpoints"), ("a folder of checkpoints", path)):
        found = latest(folder)
        if found:
            return (f"it is {kind}: name one of its checkpoints, e.g. the latest, {found} "
                    "(train --resume alone takes the latest)")
    if (path / "final").is_dir() or (path / "metrics.jsonl").is_file():
        return ("it is a run folder without a complete checkpoint (its run saved none: train.save_every); `hfsdp "
                "export` takes the run folder or its final/ as it is")
    if (path / EXPORT_RECORD).is_file() or (path / "config.json").is_file():
        return "it is a model folder (config.json), already consolidated: load or train from it instead"
    if path.name.removeprefix(".tmp-").startswith(PREFIX):
        return "its save was not finished (a run stopped while writing it): use another checkpoint"
    return "hfsdp wrote no checkpoint, run or model there"


def read_record(path: Path) -> dict[str, Any]:
    record = path / RECORD
    if not path.exists():
        raise UserError(f"{path} does not exist; name a checkpoint folder (train.output_dir/checkpoints/{PREFIX}N)")
    if not record.is_file():
        raise UserError(f"{path} is not a complete hfsdp checkpoint (no {RECORD}); {_what_it_is(path)}")
    try:
        data = json.loads(record.read_bytes().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{record} is damaged (not a JSON record: {err}); resume from or export another "
                        "checkpoint") from None
    if not isinstance(data, dict):
        raise UserError(f"{record} is damaged (not an hfsdp checkpoint record); resume from or export another checkpoint")
    return data


def saved_by_fsdp(path: Path) -> bool:
    """Whether FSDP wrote the checkpoint's model (its SHARDED or FULL layout), not a plain or DDP model."""
    return (path / "pytorch_model_fsdp_0").is_dir() or (path / "pytorch_model_fsdp.bin").is_file()


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
    # parallel.sp_size (None: written before hfsdp had sequence parallelism, i.e. 1). Not checked on resume: the
    # weights and optimizer state are sharded as without it, and a resume on another sp_size (or none) computes the
    # same steps (float32 sums of other orders apart), as on other data-parallel ranks.
    sp_size: int | None = None
    state_dict_type: str | None = None
    # schedule-free's training weights kept in the optimizer state (hfsdp.run.optimizers.evaluation_weights; None:
    # written before hfsdp kept them, or another optimizer)
    training_weights: bool | None = None
    versions: dict[str, str] = field(default_factory=dict)
    plugins: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "Record":
        """The record of the complete checkpoint at ``path`` (a UserError for a folder whose save never completed
        or a damaged record)."""
        data = read_record(path)
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{key: value for key, value in data.items() if key in known})
        except TypeError as err:
            raise UserError(f"{path / RECORD} is damaged ({err}); resume from or export another "
                            "checkpoint") from None

    @classmethod
    def of_run(cls, config: HfsdpConfig, step: int, dims: "ParallelDims", plugins: "PluginHost",
               identity: dict[str, Any], optimizer: list[dict[str, Any]],
               training_weights: bool | None = None) -> "Record":
        """The record of this run's checkpoint of ``step``. ``identity``: the run's schedule length and training
        data (``max_steps``, ``train_rows``, ``train_fingerprint``); ``optimizer``: :func:`optimizer_digest`;
        ``training_weights``: the optimizer state holds the training weights beside the model's averaged ones."""
        from importlib.metadata import version

        return cls(step=step, world_size=dims.world_size, config_hash=run_fingerprint(config),
                   global_batch=global_batch(config, dims), optimizer=optimizer,
                   state_dict_type=config.fsdp.state_dict_type, tp_size=dims.tp, sp_size=dims.sp,
                   training_weights=training_weights,
                   versions={"hfsdp": __version__, "torch": version("torch"), "accelerate": version("accelerate"),
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
        path = find_resume_checkpoint(Path(config.train.output_dir), resume)
        if path is None:
            return None, config, []
        by_fsdp = saved_by_fsdp(path)
        if world.size == 1 and by_fsdp and config.fsdp.single_process == "auto":
            config = config.model_copy(update={"fsdp": config.fsdp.model_copy(update={"single_process": "fsdp"})})
        record = Record.read(path)
        saved_tp = record.tp_size or 1
        if saved_tp != world.dims.tp:
            raise UserError(f"cannot resume from {path}: it was saved with parallel.tp_size {saved_tp}, this run has "
                            f"{config.parallel.tp_size}; a checkpoint resumes on its own tensor-parallel size (the "
                            "data-parallel ranks may change): resume with parallel.tp_size "
                            f"{saved_tp}, or export it (`hfsdp export`) and start a new run from the folder")
        config, note = keep_global_batch(record, config, world.dims, path)
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


def global_batch(config: HfsdpConfig, dims: "ParallelDims") -> int:
    """Rows a step trains on: per device x accumulation x the data-parallel ranks (a tensor-parallel group's ranks
    share their rows)."""
    return config.train.per_device_batch_size * config.train.gradient_accumulation_steps * dims.dp_size


def keep_global_batch(record: Record, config: HfsdpConfig, dims: "ParallelDims",
                      path: Path) -> tuple[HfsdpConfig, str | None]:
    """``config`` unchanged, or with the accumulation that keeps the checkpoint's global batch on this run's degrees
    ``dims`` (and a note saying so); a UserError when no accumulation does."""
    world_size = dims.world_size
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
    ranks = dims.dp_size
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
        read_record(path)  # refuses incomplete folders
        return path
    return latest(output_dir / "checkpoints")


def run_fingerprint(config: HfsdpConfig) -> str:
    """What a checkpoint records of its config: the keys that change the run (the batch keys are checked through
    the global batch, :func:`keep_global_batch`)."""
    return config.fingerprint(exclude=RESUMABLE_CHANGES + BATCH_KEYS + LAYOUT_KEYS)


def check_resume_config(record: Record, config: HfsdpConfig, path: Path) -> None:
    """The checkpoint at ``path`` was saved by a run of this config, but for the keys that may change on resume."""
    if record.config_hash != run_fingerprint(config):
        raise UserError(f"cannot resume from {path}: the config changed in keys that change the run (model, data, "
                        f"optimizer, fsdp, batch); only these may change on resume: {', '.join(RESUMABLE_CHANGES)}")
