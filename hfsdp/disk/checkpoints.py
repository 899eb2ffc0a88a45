"""A run folder's checkpoints on disk, torch-free: where each step's checkpoint goes (``checkpoints/step-N``), which
are complete (their record, ``hfsdp_checkpoint.json``, written last), the latest, the one a ``--resume`` names, a
record read back without trusting it, and whether FSDP saved the model in it. What a record holds, and what a resume
checks against it, is :mod:`hfsdp.setup.record`'s; writing checkpoints is :mod:`hfsdp.checkpoint.store`'s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hfsdp.disk.durable import EXPORT_RECORD, RECORD
from hfsdp.errors import UserError

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


def find_resume_checkpoint(output_dir: Path, resume: str) -> Path | None:
    if resume != "latest":
        path = Path(resume)
        read_record(path)  # refuses incomplete folders
        return path
    return latest(output_dir / "checkpoints")


def resumes_saved_by_fsdp(output_dir: Path, resume: str | None) -> bool:
    """Whether the checkpoint a ``--resume`` of ``resume`` continues (in ``output_dir``: "latest", or a folder) was
    saved by FSDP (False without one)."""
    path = find_resume_checkpoint(output_dir, resume) if resume else None
    return path is not None and saved_by_fsdp(path)
