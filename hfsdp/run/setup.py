"""The run decided once, before any weight loads: :class:`RunSetup` (world, wrapper, effective config, resume point).

The CLI reads argv and the environment, then asks :func:`decide` for the run; ``train``, the resume component and
the plugins' model hooks read the answer instead of deciding again. Every problem that the config, the world and
the checkpoint to resume show is found here and reported at once: nothing has been loaded yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.config.schema import HfsdpConfig
from hfsdp.errors import ConfigError, UserError
from hfsdp.parallel.world import World
from hfsdp.rules.attention import attention_problems
from hfsdp.rules.wrapping import FSDP_WRAPPERS, Wrapper, check_world, rehearsal_problems, wrapper
from hfsdp.run.optimizers import wrapper_problems


@dataclass(frozen=True)
class ResumePoint:
    """The complete checkpoint a ``--resume`` continues from and its record (``hfsdp_checkpoint.json``), already
    checked against the run's config (its data and schedule are checked once the data is read:
    ``resume.check_resume_record``)."""

    path: Path
    record: dict[str, Any]


@dataclass(frozen=True)
class RunSetup:
    config: HfsdpConfig  # the effective config: what this run trains with (see decide)
    world: World
    resume: ResumePoint | None  # None: from step 0 (no --resume, or no complete checkpoint yet)
    resume_asked: bool = False  # --resume was given
    notes: tuple[str, ...] = ()  # what decide changed in the config and why, for the console

    @property
    def wrapper(self) -> Wrapper:
        """What wraps the model: the one rule (``hfsdp.rules.wrapping.wrapper``) applied to the effective config."""
        return wrapper(self.config.fsdp, self.world.size)

    @property
    def fsdp(self) -> bool:
        """FSDP (version 1 or 2) wraps the model."""
        return self.wrapper in FSDP_WRAPPERS


def one_process(config: HfsdpConfig) -> RunSetup:
    """A run of ``config`` on one process with nothing to resume: what ``hfsdp plan`` and the start-up space
    estimate give the model hooks when they build the model on the meta device."""
    return RunSetup(config=config, world=World(rank=0, size=1, local_size=1, on_cpu=False), resume=None)


def decide(config: HfsdpConfig, world: World, resume: str | None, source: str = "config") -> RunSetup:
    """The run ``config`` makes on ``world`` (what the launcher started), resuming from ``resume`` ("latest", a
    checkpoint folder, or None). The config is made effective here, each change said in ``notes``:

    * one process resuming a checkpoint that FSDP saved keeps FSDP (``fsdp.single_process: fsdp``): only FSDP reads
      FSDP's checkpoint layouts;
    * a checkpoint of another world size resumes with the accumulation that keeps its global batch.

    Raises ConfigError with every config problem of this world at once, then UserError for a checkpoint that
    cannot resume here."""
    from hfsdp.checkpoint import store as checkpoint
    from hfsdp.checkpoint import resume as resuming

    problems = (check_world(config.fsdp, world.size, world.local_size) + attention_problems(config, world.on_cpu)
                + wrapper_problems(config, wrapper(config.fsdp, world.size)))
    if world.on_cpu:
        problems += rehearsal_problems(config)
    if problems:
        raise ConfigError(problems, source=source)
    point, notes = None, []
    if resume:
        path = resuming.find_resume_checkpoint(Path(config.train.output_dir), resume)
        if path is not None:
            by_fsdp = checkpoint.saved_by_fsdp(path)
            if world.size == 1 and by_fsdp and config.fsdp.single_process == "auto":
                config = config.model_copy(update={"fsdp": config.fsdp.model_copy(update={"single_process": "fsdp"})})
            record = checkpoint.read_record(path)
            config, note = resuming.keep_global_batch(record, config, world.size, path)
            notes += [note] if note else []
            if wrapper(config.fsdp, world.size) in FSDP_WRAPPERS and not by_fsdp:
                raise UserError(f"cannot resume from {path} under FSDP: one process without a wrapper (or DDP) "
                                "saved it; resume it on one process, or start runs that must resume on other world "
                                "sizes with fsdp.single_process: fsdp")
            resuming.check_resume_config(record, config, path)
            point = ResumePoint(path, record)
    setup = RunSetup(config=config, world=world, resume=point, resume_asked=bool(resume), notes=tuple(notes))
    if config.train.async_save and setup.wrapper == "none" and not config.fsdp.runs_as_ddp:
        raise ConfigError([("train.async_save", "one process runs the model without FSDP (fsdp.single_process: "
                                                "auto), and its checkpoint is one file: set fsdp.single_process: "
                                                "fsdp, or remove train.async_save")], source=source)
    return setup
