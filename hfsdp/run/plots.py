"""Pictures of runs from their ``metrics.jsonl``: train loss, eval loss and learning rate against step, one run or
several overlaid. matplotlib is optional (``pip install matplotlib``; the ``bench`` extra has it): without it nothing
is written, and the callers say so."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hfsdp.disk.lock import put_back_abandoned
from hfsdp.errors import UserError

PANELS = (("loss", "train loss"), ("eval_loss", "eval loss"), ("lr", "learning rate"))
MISSING = "matplotlib is not installed (pip install matplotlib)"


class PlotUnavailable(UserError):
    """matplotlib cannot be imported."""


def pyplot(what: str):
    """``matplotlib.pyplot`` on the Agg backend (files only), or PlotUnavailable naming ``what`` was not written:
    the one guard of every hfsdp plot (``hfsdp plot``, the run's loss.png, ``plan --png``, bench.png)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"{MISSING}: {what} not written") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per panel key, in file order, finite values only."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (give the train.output_dir of a run)")
    series: dict[str, list[tuple[int, float]]] = {key: [] for key, _ in PANELS}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{number}: not a JSON line") from None
        for key in series:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                series[key].append((int(record["step"]), float(value)))
    return series


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """Write one PNG with a panel per metric and a line per run; raises PlotUnavailable without matplotlib. (A run
    killed before its first step left the run it replaced set aside: put back first.)"""
    for folder in run_dirs:
        put_back_abandoned(folder)
    runs = {_label(d, run_dirs): read_series(d) for d in run_dirs}
    plt = pyplot(str(out))

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (key, title) in zip(axes, PANELS):
        for label, series in runs.items():
            points = series[key]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=label)
        if not any(series[key] for series in runs.values()):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_plot(output_dir: Path) -> str:
    """``<output_dir>/loss.png`` at the end of a run; the line to print, saying whether it was written."""
    try:
        return f"loss curves: {plot_runs([output_dir], output_dir / 'loss.png')}"
    except PlotUnavailable:
        return f"loss.png not written: {MISSING}"


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    names = [Path(d).resolve().name for d in all_dirs]
    name = Path(run_dir).resolve().name
    return name if names.count(name) == 1 else str(run_dir)
