"""Metrics: one JSON object per logged step in ``<output_dir>/metrics.jsonl`` (always, on the main process), and
the same values to the experiment trackers named in ``train.report_to``, which Accelerate drives (``log_with``).

The trackers get the resolved config as hyper-parameters, flattened to dotted keys (``train.learning_rate``).

A resumed run continues the same file: the records of steps it will train again (those after its checkpoint, or
all of them when it starts over from step 0) are dropped first, so that every step appears once however often the
run was interrupted and restarted (an online objective's ``completions.jsonl`` too). TensorBoard purges its events
of those steps likewise.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


# The name trackers file the run under: TensorBoard's sub-folder of <output_dir>/tensorboard, MLflow's experiment,
# W&B's project.
TRACKER_PROJECT = "hfsdp"


STEP_LOGS = ("metrics.jsonl", "completions.jsonl")
"""The run folder's logs of records by step (an online objective's completions: the step that sampled them): a
resumed run drops the records of the steps it trains again."""


class MetricsWriter:
    """Writes on the main process only; on other ranks ``write`` does nothing (Accelerate's trackers, likewise)."""

    def __init__(self, output_dir: Path, accelerator, config: dict[str, Any], trackers: bool,
                 continue_from: int | None = None):
        """``continue_from``: the step a resumed run starts at (None when it is not a resume)."""
        self.enabled = accelerator.is_main_process
        self._accelerator = accelerator if trackers else None
        path = output_dir / "metrics.jsonl"
        if self.enabled and continue_from is not None:
            for log in STEP_LOGS:
                if (output_dir / log).exists():
                    drop_replayed_records(output_dir / log, continue_from)
        self._file = open(path, "a") if self.enabled else None
        if self._accelerator is not None:
            # purge_step: TensorBoard hides the events of the steps trained again, as the file above drops them.
            purge = {} if continue_from is None else {"tensorboard": {"purge_step": continue_from + 1 if continue_from else 0}}
            accelerator.init_trackers(TRACKER_PROJECT, config=hyperparameters(config), init_kwargs=purge)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._accelerator is not None:
            numbers = {k: v for k, v in metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            self._accelerator.log(numbers, step=step)

    def close(self) -> None:
        """Closes metrics.jsonl; the trackers are finished by ``accelerator.end_training()``."""
        if self._file is not None:
            self._file.close()
            self._file = None


def hyperparameters(config: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """The nested config as flat ``section.key`` → scalar (lists as JSON, null as "null"): what trackers accept."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(hyperparameters(value, prefix=f"{name}."))
        elif value is None:
            flat[name] = "null"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def drop_replayed_records(path: Path, continue_from: int) -> int:
    """Keep the records of steps up to ``continue_from`` (none when it is 0: the run starts over, eval at start
    included) and drop a last line cut short by a killed process; returns how many lines were dropped."""
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and continue_from > 0 and _step(line) <= continue_from]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0  # not a record of ours: kept


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
