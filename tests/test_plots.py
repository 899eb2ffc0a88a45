"""Loss pictures: ``hfsdp plot RUN_DIR ...`` overlays runs from their metrics.jsonl; without matplotlib nothing is
written and the output says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import run_cli

from hfsdp.cli import cli
from hfsdp.run.plots import read_series, run_plot

C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colors


def _run(folder: Path, scale: float) -> Path:
    folder.mkdir(parents=True)
    lines = [{"step": 0, "eval_loss": 3.0 * scale}]
    lines += [{"step": s, "loss": scale * (3.0 - 0.2 * s), "lr": 1e-3 * (1 - s / 10), "tokens_per_s": 100.0}
              for s in range(1, 11)]
    lines += [{"step": 5, "eval_loss": 2.2 * scale}, {"step": 10, "eval_loss": float("nan")}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r).replace("NaN", '"nan"') + "\n" for r in lines))
    return folder


def _colors(png: Path) -> set[tuple[int, int, int]]:
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(png))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(p) for p in pixels.tolist()}


def test_read_series_keeps_finite_values_by_step(tmp_path):
    series = read_series(_run(tmp_path / "a", 1.0))
    assert series["eval_loss"] == [(0, 3.0), (5, 2.2)]  # the "nan" eval is left out
    assert [s for s, _ in series["loss"]] == list(range(1, 11)) and series["lr"][0] == (1, pytest.approx(9e-4))


def test_plot_overlays_runs(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 0.5)
    out = tmp_path / "both.png"
    proc = run_cli("plot", str(a), str(b), "-o", str(out))
    assert proc.stdout.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {C0, C1} <= _colors(out)  # one line per run
    single = tmp_path / "one.png"
    run_cli("plot", str(a), "-o", str(single))
    assert C0 in _colors(single) and C1 not in _colors(single)


def test_plot_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    proc = run_cli("plot", str(tmp_path), "-o", str(tmp_path / "x.png"), check=False)
    assert proc.returncode == 2
    assert f"{tmp_path}: no metrics.jsonl (give the train.output_dir of a run)" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_nothing_is_written_and_the_output_says_so(tmp_path, monkeypatch):
    run = _run(tmp_path / "a", 1.0)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert run_plot(run) == "loss.png not written: matplotlib is not installed (pip install matplotlib)"
    result = CliRunner().invoke(cli, ["plot", str(run), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "matplotlib is not installed (pip install matplotlib): " in result.output and "not written" in result.output
    assert not (run / "loss.png").exists() and not (tmp_path / "x.png").exists()
