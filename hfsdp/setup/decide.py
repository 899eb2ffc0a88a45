"""The run decided once, before any weight loads: :class:`RunSetup` (the effective config, the world with its
parallel degrees and the wrapper they make, the resume point).

The CLI reads argv and the environment, reads the config (:mod:`hfsdp.config`), has the rule table check it against
what it runs on (:func:`hfsdp.rules.table.enforce`: the config, its data, the world, the model), then asks
:func:`decide` for the run; ``train``, the resume component and the plugins' model hooks read the answer instead of
deciding again. Deciding checks nothing the rule table checks: only what a checkpoint to resume allows
(:meth:`hfsdp.setup.record.Resume.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.config.schema import HfsdpConfig
from hfsdp.layout.degrees import World, Wrapper
from hfsdp.setup.record import Resume


@dataclass(frozen=True)
class RunSetup:
    config: HfsdpConfig  # the effective config: what this run trains with (see decide)
    world: World  # with the run's degrees (world.dims)
    resume: Resume | None  # None: from step 0 (no --resume, or no complete checkpoint yet)
    resume_asked: bool = False  # --resume was given
    notes: tuple[str, ...] = ()  # what decide changed in the config and why, for the console

    @property
    def wrapper(self) -> Wrapper:
        """What wraps the model: the degrees' answer (:meth:`hfsdp.layout.degrees.ParallelDims.of`)."""
        return self.world.dims.wrapper

    @property
    def fsdp(self) -> bool:
        """FSDP (version 1 or 2) wraps the model."""
        return self.world.dims.fsdp


def one_process(config: HfsdpConfig) -> RunSetup:
    """A run of ``config`` on one process with nothing to resume: what ``hfsdp plan`` and the start-up space
    estimate give the model hooks when they build the model on the meta device."""
    return RunSetup(config=config, world=World(rank=0, size=1, local_size=1, on_cpu=False).with_dims(config),
                    resume=None)


def decide(config: HfsdpConfig, world: World, resume: str | None) -> RunSetup:
    """The run ``config`` makes on ``world`` (what the launcher started), resuming from ``resume`` ("latest", a
    checkpoint folder, or None). The config is made effective here, each change said in ``notes``, by the resume's
    first phase (:meth:`hfsdp.setup.record.Resume.decide`), and the world's degrees derived from it.

    Raises UserError for a checkpoint that cannot resume here. The rule table's phases are checked before
    (:func:`hfsdp.rules.table.enforce`)."""
    world = world.with_dims(config)
    point, notes = None, []
    if resume:
        point, config, notes = Resume.decide(config, world, resume)
        world = world.with_dims(config)  # the config the checkpoint resumes with (FSDP kept on one process)
    return RunSetup(config=config, world=world, resume=point, resume_asked=bool(resume), notes=tuple(notes))
