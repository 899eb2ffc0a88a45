"""What a run holds while it trains, as the hooks receive it (:class:`Run`), the progress a checkpoint carries
(:class:`TrainerState`), and what the CLI read besides the decided run (:class:`Options`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hfsdp.config.schema import HfsdpConfig
from hfsdp.model.metadata import ModelFiles
from hfsdp.hooks.host import PluginHost
from hfsdp.objective import Objective, TokenCrossEntropy
from hfsdp.layout.degrees import World


@dataclass
class TrainerState:
    """Progress that a checkpoint must carry besides model, optimizer and RNG (registered with Accelerate)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


@dataclass
class Run:
    """What hooks receive as ``run``."""

    config: HfsdpConfig
    accelerator: Any
    model: Any
    tokenizer: Any
    output_dir: Path
    state: TrainerState
    plugins: PluginHost
    is_main_process: bool
    extras: dict[str, Any] = field(default_factory=dict)  # for plugins; hfsdp keeps nothing here
    world: World | None = None
    optimizer: Any = None  # as prepared by Accelerate (``.optimizer`` is the torch optimizer)
    model_config: Any = None  # the transformers config
    generation_config: dict[str, Any] | None = None  # the model's generation_config.json, as exports write it
    model_files: ModelFiles | None = None  # what checkpoints and exports write besides the weights
    resume_identity: dict[str, Any] = field(default_factory=dict)  # the schedule length and data a resume must keep
    # what the loop trains: ``objective(model, batch)`` is the micro-batch's summed loss (a plugin's, hook
    # hfsdp_objective, else next-token cross entropy)
    objective: Objective = field(default_factory=TokenCrossEntropy)
    # a mixture-of-experts model's routing (hfsdp.model.experts.Router: its load-balancing loss and metrics); None
    # for a dense model
    router: Any = None


@dataclass
class Options:
    """What the CLI read of argv and the environment besides the run it decided (``RunSetup``)."""

    cache_dir: Path
    overwrite: bool = False
    malloc_set: bool = False  # the environment sets glibc's malloc itself (hfsdp.run.heap): its settings win
