"""A checkpoint as the decided run sees it, before anything loads (its folder on disk: :mod:`hfsdp.disk.checkpoints`):
what a checkpoint records of its run (:class:`Record`, ``hfsdp_checkpoint.json``,
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

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsdp import __version__
from hfsdp.config.schema import HfsdpConfig, MayChangeOnResume, Section
from hfsdp.disk.checkpoints import CONFIG_NAME, find_resume_checkpoint, read_record, saved_by_fsdp
from hfsdp.disk.durable import RECORD
from hfsdp.errors import UserError

if TYPE_CHECKING:
    from hfsdp.hooks.host import PluginHost
    from hfsdp.layout.degrees import ParallelDims, World

def resumable_keys(model: type = HfsdpConfig, prefix: str = "") -> tuple[str, ...]:
    """The keys a resume may change (:data:`hfsdp.config.schema.Resumable`, as the schema declares them), dotted;
    anything else changes the run and is refused. The batch keys among them may change as long as the global batch
    they make stays the same (:func:`keep_global_batch`); the layout (``parallel``) as long as ``tp_size`` does
    (:attr:`Record.tp_size`, with its own message)."""
    keys: list[str] = []
    for name, declared in model.model_fields.items():
        if any(isinstance(m, MayChangeOnResume) for m in declared.metadata):
            keys.append(prefix + name)
        elif isinstance(declared.annotation, type) and issubclass(declared.annotation, Section):
            keys += resumable_keys(declared.annotation, f"{prefix}{name}.")
    return tuple(keys)


RESUMABLE_CHANGES = resumable_keys()


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
    cp_size: int | None = None  # parallel.cp_size (None: written before ring attention), not checked, as sp_size
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
                   state_dict_type=config.fsdp.state_dict_type, tp_size=dims.tp, sp_size=dims.sp, cp_size=dims.cp,
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
        if world.with_dims(config).dims.fsdp and not by_fsdp:
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


# Keys that change the run, added to the schema after checkpoints began recording run_fingerprint, each with its
# default: left out of the fingerprint at that default, so that a checkpoint written before them keeps its
# fingerprint (a run that sets one otherwise still differs from it).
ADDED_SINCE_FINGERPRINT = {"model.router_aux_loss_coef": None, "model.freeze": [], "data.image_max_pixels": None}


def run_fingerprint(config: HfsdpConfig) -> str:
    """What a checkpoint records of its config: the keys that change the run (not :data:`RESUMABLE_CHANGES`, nor
    a key of :data:`ADDED_SINCE_FINGERPRINT` at its default)."""
    data = config.to_yaml_dict()
    dropped = [*RESUMABLE_CHANGES, *(key for key, default in ADDED_SINCE_FINGERPRINT.items()
                                     if _value(data, key) == default)]
    for dotted in dropped:
        parent, _, leaf = dotted.rpartition(".")
        node = data
        for part in filter(None, parent.split(".")):
            node = node.get(part, {})
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _value(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part, {}) if isinstance(data, dict) else {}
    return data


def check_resume_config(record: Record, config: HfsdpConfig, path: Path) -> None:
    """The checkpoint at ``path`` was saved by a run of this config, but for the keys that may change on resume
    (:data:`RESUMABLE_CHANGES`). The checkpoint's own config (``hfsdp_config.yaml``), read by today's schemas, is
    compared key by key, so that a key added to hfsdp since it was written takes its default there (an earlier
    checkpoint resumes) and the keys that differ are named; a checkpoint whose config today's schemas cannot read is
    compared by its record's fingerprint."""
    saved = _saved_config(path, config)
    if saved is None:
        if record.config_hash == run_fingerprint(config):
            return
        changed = ""
    else:
        before, now = _run_keys(saved), _run_keys(config)
        differ = [key for key in sorted(before.keys() | now.keys()) if before.get(key) != now.get(key)]
        if not differ:
            return
        changed = ": " + "; ".join(f"{key} ({before.get(key)!r} in the checkpoint, {now.get(key)!r} now)"
                                   for key in differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    raise UserError(f"cannot resume from {path}: the config changed in keys that change the run{changed}; only these "
                    f"may change on resume: {', '.join(RESUMABLE_CHANGES)}")


def _saved_config(path: Path, config: HfsdpConfig) -> HfsdpConfig | None:
    """The config a checkpoint was saved with, read by today's schemas (the core's and those of this run's plugin
    sections), or None where it is missing or they refuse it."""
    import yaml

    from hfsdp.config.validate import validate_config

    try:
        raw = yaml.safe_load((path / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(raw, dict):
        return None
    sections = {name: (name, type(section)) for name, section in config.plugin_config.items()}
    try:
        saved, problems = validate_config(raw, sections)
    except Exception:  # noqa: BLE001 (a config hfsdp wrote is refused by today's schemas in whatever way)
        return None
    return None if problems else saved


def _run_keys(config: HfsdpConfig) -> dict[str, Any]:
    """The config's values by dotted key, but for the keys that may change on resume."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if prefix.rstrip(".") in RESUMABLE_CHANGES:
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix.rstrip(".")] = node

    walk(config.to_yaml_dict(), "")
    return out
