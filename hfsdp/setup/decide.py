"""The run decided once, before any weight loads: :class:`RunSetup` (world, wrapper, effective config, resume point).

The CLI reads argv and the environment, then asks :func:`decide` for the run (the world's parallel degrees,
:class:`hfsdp.setup.degrees.ParallelDims`, derived here once); ``train``, the resume component and
the plugins' model hooks read the answer instead of deciding again. Every problem that the config, the world and
the checkpoint to resume show is found here and reported at once: nothing has been loaded yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.config.schema import HfsdpConfig
from hfsdp.errors import ConfigError
from hfsdp.hooks.host import PluginHost
from hfsdp.rules.table import Facts, check
from hfsdp.rules.wrapping import FSDP_WRAPPERS, Wrapper, wrapper
from hfsdp.setup import degrees
from hfsdp.setup.degrees import World
from hfsdp.setup.record import Resume


@dataclass(frozen=True)
class RunSetup:
    config: HfsdpConfig  # the effective config: what this run trains with (see decide)
    world: World
    resume: Resume | None  # None: from step 0 (no --resume, or no complete checkpoint yet)
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
    return RunSetup(config=config, world=World(rank=0, size=1, local_size=1, on_cpu=False).with_dims(config),
                    resume=None)


def decide(config: HfsdpConfig, world: World, resume: str | None, source: str = "config",
           plugins: PluginHost | None = None) -> RunSetup:
    """The run ``config`` makes on ``world`` (what the launcher started), resuming from ``resume`` ("latest", a
    checkpoint folder, or None), with the enabled ``plugins`` (default: those ``config`` names). The config is made
    effective here, each change said in ``notes``, by the resume's first phase
    (:meth:`hfsdp.setup.record.Resume.decide`), and the world's degrees derived from it.

    Raises UserError for a checkpoint that cannot resume here, and ConfigError with every problem the rule table's
    ``world`` phase finds in the effective config on this world (a resume reads the degrees only once they are
    valid)."""
    plugins = plugins if plugins is not None else PluginHost(config.plugins)
    world = world.with_dims(config)
    point, notes = None, []
    if resume and not degrees.problems(config, world.size, world.local_size):
        point, config, notes = Resume.decide(config, world, resume)
        world = world.with_dims(config)  # the config the checkpoint resumes with (FSDP kept on one process)
    if problems := check("world", config, Facts(plugins=plugins, world=world)):
        raise ConfigError(problems, source=source)
    return RunSetup(config=config, world=world, resume=point, resume_asked=bool(resume), notes=tuple(notes))
