"""Metrics: one JSON object per logged step in ``<output_dir>/metrics.jsonl`` (always, on the main process), and
the same values to the experiment trackers named in ``train.report_to``, which Accelerate drives (``log_with``).

The trackers get the resolved config as hyper-parameters, flattened to dotted keys (``train.learning_rate``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# The name trackers file the run under: TensorBoard's sub-folder of <output_dir>/tensorboard, MLflow's experiment,
# W&B's project.
TRACKER_PROJECT = "hfsdp"


class MetricsWriter:
    """Writes on the main process only; on other ranks ``write`` does nothing (Accelerate's trackers, likewise)."""

    def __init__(self, output_dir: Path, accelerator, config: dict[str, Any], trackers: bool):
        self.enabled = accelerator.is_main_process
        self._accelerator = accelerator if trackers else None
        self._file = open(output_dir / "metrics.jsonl", "a") if self.enabled else None
        if self._accelerator is not None:
            accelerator.init_trackers(TRACKER_PROJECT, config=hyperparameters(config))

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


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
