"""hfsdp plugin ``eval_log``: append the metrics of every evaluation to a table in the run folder.

Config section ``eval_log:``::

    eval_log:
      file: eval_log.csv      # relative to train.output_dir
      style: csv              # csv | markdown
      metrics: [eval_loss, eval_ppl]

One row per evaluation (before training, every ``train.eval_every`` steps, after training), written by the main
process only; a resumed run appends to the same file.
"""

import csv
import io
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hfsdp import hookimpl

__version__ = "0.1.0"


class EvalLogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str = Field("eval_log.csv", description="table file, relative to train.output_dir")
    style: Literal["csv", "markdown"] = "csv"
    metrics: list[str] = Field(default_factory=lambda: ["eval_loss", "eval_ppl"], min_length=1)


@hookimpl
def hfsdp_config_section():
    return "eval_log", EvalLogConfig


@hookimpl
def hfsdp_validate_config(config):
    section = config.section("eval_log")
    if Path(section.file).is_absolute() or ".." in Path(section.file).parts:
        return [("eval_log.file", "give a file name inside train.output_dir")]
    return None


def _line(cells: list[str], style: str) -> str:
    if style == "markdown":
        return "| " + " | ".join(cells) + " |\n"
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


@hookimpl
def hfsdp_on_eval(run, step, metrics):
    if not run.is_main_process:
        return
    section = run.config.section("eval_log")
    path = Path(run.output_dir) / section.file
    columns = ["step", *section.metrics, "time"]
    text = ""
    if not path.exists():
        text += _line(columns, section.style)
        if section.style == "markdown":
            text += _line(["---"] * len(columns), section.style)
    values = [f"{metrics[m]:.6g}" if isinstance(metrics.get(m), float) else str(metrics.get(m, "")) for m in section.metrics]
    text += _line([str(step), *values, time.strftime("%Y-%m-%dT%H:%M:%S")], section.style)
    with open(path, "a") as f:
        f.write(text)
