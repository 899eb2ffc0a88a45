"""What a launcher (torchrun, ``accelerate launch``, a scheduler) put in the environment, and what hfsdp makes of it
before anything loads: the rank variables checked, the process's place in the job, the variables a run without a
wrapper drops (or a one-rank FSDP job sets), and the FSDP and Accelerate settings that the hfsdp config overrides.
Each function takes the environment as an argument: only the CLI reads the process's own (``os.environ``). Also a
free local TCP port for a rendezvous (:func:`free_port`). No torch, so the CLI stays light.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from hfsdp.errors import UserError

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.setup.decide import RunSetup
    from hfsdp.layout.degrees import World

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT`` / ``torchrun --master-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launcher settings that Accelerate would otherwise apply on its own; the hfsdp YAML is the source of truth.
# Every ACCELERATE_* variable Accelerate reads goes, except these few that only change logging, debugging checks
# and CPU affinity (read from accelerate's source: state.py, accelerator.py, utils/dataclasses.py, utils/launch.py,
# big_modeling.py). The ones that change the math include ACCELERATE_GRADIENT_ACCUMULATION_STEPS (backward()
# divides the loss by it), ACCELERATE_MIXED_PRECISION, ACCELERATE_DYNAMO_* (torch.compile), ACCELERATE_USE_CPU,
# ACCELERATE_TORCH_DEVICE, ACCELERATE_USE_PARALLELISM_CONFIG with PARALLELISM_CONFIG_* (the device mesh),
# ACCELERATE_INIT_INCLUDE_BUFFERS, ACCELERATE_FP8_*, ACCELERATE_DOWNCAST_BF16 and the DeepSpeed/Megatron switches.
_LAUNCHER_PREFIXES = ("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")
_HARMLESS_ACCELERATE = ("ACCELERATE_LOG_LEVEL", "ACCELERATE_DEBUG_MODE", "ACCELERATE_CPU_AFFINITY",
                        "ACCELERATE_ENABLE_RICH", "ACCELERATE_DEBUG_RDV_FILE")
# Values launchers export when nothing was chosen (`accelerate launch` writes every dynamo key, "no" precision...).
_NEUTRAL_VALUES = ("", "no", "false", "0", "default", "none")
_NEUTRAL = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": None}  # None: any value (Accelerate's plugin sets it itself)
_RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCH_HINT = ("launch with torchrun or accelerate launch (they set all of WORLD_SIZE, RANK, LOCAL_RANK, "
                "MASTER_ADDR, MASTER_PORT), or unset WORLD_SIZE, RANK and LOCAL_RANK to train on one process")


def check_rank_variables(env: Mapping[str, str]) -> None:
    """Rank variables left in ``env`` by hand or by another tool, refused before they reach torch."""
    for key in _RANK_VARIABLES:
        value = env.get(key)
        least = 1 if key.endswith("WORLD_SIZE") else 0
        if value is not None and not (value.isdigit() and int(value) >= least):
            raise UserError(f"environment variable {key}={value!r} is not a valid {key.lower().replace('_', ' ')}; "
                            + _LAUNCH_HINT)
    size = int(env.get("WORLD_SIZE", "1"))
    if int(env.get("RANK", "0")) >= size:
        raise UserError(f"RANK={env['RANK']} is not below WORLD_SIZE={size}; " + _LAUNCH_HINT)
    if size == 1:
        return
    missing = [key for key in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(key)]
    if missing:
        raise UserError(f"WORLD_SIZE={size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                        "not, so this process cannot join a job; " + _LAUNCH_HINT)


def launched_world(env: Mapping[str, str], on_cpu: bool) -> "World":
    """The process's place in the job, as the launcher set it in ``env`` (one process when no launcher did)."""
    from hfsdp.layout.degrees import World  # the config schema's pydantic: not for `hfsdp --help`

    size = int(env.get("WORLD_SIZE", "1"))
    return World(rank=int(env.get("RANK", "0")), size=size,
                 local_size=int(env.get("LOCAL_WORLD_SIZE", size)), on_cpu=on_cpu)


def apply_wrapper(env: MutableMapping[str, str], setup: "RunSetup") -> None:
    """One process that runs without a wrapper drops a launcher's rank variables (a one-process torchrun), so that
    Accelerate builds no process group and wraps nothing; one that keeps FSDP (``cpu_offload``,
    ``fsdp.single_process: fsdp``, resuming an FSDP checkpoint) becomes a one-rank job, so that it runs the same FSDP
    code path as many."""
    if setup.world.size == 1 and setup.wrapper == "none":
        for key in _RANK_VARIABLES:
            env.pop(key, None)
    elif "WORLD_SIZE" not in env and "LOCAL_RANK" not in env:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))


def take_launcher_settings(env: MutableMapping[str, str], config: "HfsdpConfig", on_cpu: bool) -> list[str]:
    """Remove FSDP and Accelerate settings a launcher put in ``env``, and say which hfsdp value wins."""
    notes = []
    # hfsdp runs on the CPU exactly when no GPU is visible: a launcher saying the same changes nothing.
    agrees = {**_NEUTRAL, "ACCELERATE_USE_CPU": "true" if on_cpu else "false"}
    for key in sorted(env):
        if key.startswith(_LAUNCHER_PREFIXES) and key not in _HARMLESS_ACCELERATE:
            value = env.pop(key)
            neutral = agrees.get(key, "")
            if value.lower() in _NEUTRAL_VALUES or neutral is None or value.lower() == neutral:
                continue
            notes.append(f"launcher setting {key}={value} ignored: the hfsdp config decides "
                         f"(fsdp.version {config.fsdp.version}, {config.fsdp.sharding_strategy}, "
                         f"mixed precision {config.fsdp.precision_name})")
    return notes


def first_to_say(env: Mapping[str, str], line: str) -> bool:
    """Whether this rank prints ``line``, a user's error (the same on every rank that finds it: a config error is
    found by all): under torchrun, whose per-attempt folder (the parent of each worker's ``TORCHELASTIC_ERROR_FILE``
    folder) the ranks of a node share, only the first rank that fails prints it, and another only a line of its own;
    elsewhere (one process, ``mpirun``) every rank prints. Each rank also writes ``line`` into its error file, which
    torchrun's failure report shows in place of a link to its documentation."""
    said = _said_file(env)
    if said is None:
        return True
    import json
    import os
    import time

    error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}))
        mine = said.with_name(f"{said.name}.{os.getpid()}")
        mine.write_text(line)
        try:
            os.link(mine, said)  # the first rank's line, whole, or nothing
            return True
        except FileExistsError:
            return said.read_text() != line
        finally:
            mine.unlink(missing_ok=True)
    except OSError:  # the folder is not writable: say it here
        return True


def another_rank_said(env: Mapping[str, str]) -> bool:
    """Whether a rank of this node already printed its error (:func:`first_to_say`): torchrun then stops the others
    (SIGTERM), which need not say so."""
    said = _said_file(env)
    return said is not None and said.exists()


def _said_file(env: Mapping[str, str]) -> Path | None:
    """Where the first failing rank of a torchrun job's node writes its error (None outside torchrun)."""
    if not env.get("TORCHELASTIC_ERROR_FILE") or env.get("WORLD_SIZE", "1") == "1":
        return None
    return Path(env["TORCHELASTIC_ERROR_FILE"]).parent.parent / "hfsdp-error.txt"
