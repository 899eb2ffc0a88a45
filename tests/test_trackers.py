"""What a run reports: experiment trackers through Accelerate (train.report_to) — TensorBoard and MLflow (a local
file store) receive the same values as metrics.jsonl, read back through each tracker's own reader — the per-step
throughput and memory metrics, and the end-of-run summary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from conftest import base_env, read_metrics, run_cli, tiny_config

from hfsdp.config.schema import TRACKERS


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, str, str]:
    tmp = tmp_path_factory.mktemp("tracked")
    config = tiny_config(tmp, train={"max_steps": 3, "report_to": ["tensorboard", "mlflow"], "loss_plot": True})
    store = f"file://{tmp / 'mlruns'}"
    # MLflow 3 refuses its file store unless asked; the file store is what runs offline without a database.
    proc = run_cli("train", str(config), env=base_env(MLFLOW_TRACKING_URI=store, MLFLOW_ALLOW_FILE_STORE="true"))
    return tmp / "run", store, proc.stdout


@pytest.mark.slow
def test_tensorboard_and_mlflow_get_the_metrics_jsonl_values(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, store, _ = tracked_run
    records = read_metrics(run)
    expected = {key: {r["step"]: r[key] for r in records if key in r}
                for key in ("loss", "eval_loss", "lr", "tokens_per_s", "tflops", "mem_rss_gib")}
    assert len(expected["loss"]) == 3 and len(expected["eval_loss"]) == 2  # before and after training

    events = EventAccumulator(str(run / "tensorboard" / "hfsdp"))
    events.Reload()
    for key, by_step in expected.items():
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got.keys() == by_step.keys(), key
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6), (key, step)  # TensorBoard stores float32

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "hfsdp"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    for key, by_step in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, key)}
        assert got == pytest.approx(by_step, rel=1e-12), key
    params = mlflow_run.data.params  # the resolved config as hyper-parameters
    assert params["train.learning_rate"] == "0.003" and params["model.name_or_path"] == "smollm2-tiny"
    assert params["train.report_to"] == '["tensorboard", "mlflow"]'


@pytest.mark.slow
def test_every_step_reports_throughput_and_memory_and_the_summary_their_medians(tracked_run):
    import json
    import statistics

    run, _, stdout = tracked_run
    steps = [r for r in read_metrics(run) if "loss" in r]
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"]  # one process
        # the shrunk SmolLM2 (tied head, 2 layers) costs at least 6 N FLOPs per token, N = its 3.27M parameters
        assert r["tflops"] * 1e12 >= 6 * 3_268_928 * r["tokens_per_s"]
        assert 0.05 < r["mem_rss_gib"] <= r["mem_peak_rss_gib"] < 64
        assert "mfu_pct" not in r and "mem_max_allocated_gib" not in r  # CPU: no peak FLOP/s, no CUDA allocator
    speed = json.loads((run / "summary.json").read_text())["throughput"]
    assert speed["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in steps[1:]))
    assert speed["params_for_flops"] == 3_268_928 and len(speed["peak_memory_gib_per_rank"]) == 1
    assert f"loss curves: {run / 'loss.png'}" in stdout.splitlines()  # written at the end of the run
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = next(line for line in stdout.splitlines() if line.startswith("throughput: "))
    assert line == (f"throughput: median {speed['tokens_per_s']:.0f} tokens/s ({speed['tokens_per_s']:.0f}/device), "
                    f"{speed['tflops']:.3g} TFLOP/s/device; peak memory per rank (peak RSS): "
                    f"{speed['peak_memory_gib_per_rank'][0]:.2f} GiB")


def test_tracker_not_installed_is_a_config_error(tmp_path):
    missing = [name for name, (module, _) in TRACKERS.items() if importlib.util.find_spec(module) is None]
    if not missing:
        pytest.skip("every known tracker is installed here")
    name = missing[0]
    proc = run_cli("validate", str(tiny_config(tmp_path, train={"report_to": ["tensorboard", name]})), check=False)
    assert proc.returncode == 2
    assert f"train.report_to: tracker '{name}' is not installed: pip install {TRACKERS[name][1]}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("train, expected", [
    ({}, ["tensorboard"]),
    ({"report_to": "none"}, []),
    ({"report_to": ["none"]}, []),
    ({"report_to": "mlflow"}, ["mlflow"]),
    ({"tensorboard": False}, []),  # the deprecated key of older configs keeps validating
    ({"tensorboard": True}, ["tensorboard"]),
])
def test_report_to_forms(tmp_path, train, expected):
    config = tiny_config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["train"].pop("report_to")
    raw["train"].update(train)
    config.write_text(yaml.safe_dump(raw))
    resolved = yaml.safe_load(run_cli("validate", str(config)).stdout)
    assert resolved["train"]["report_to"] == expected
    assert "tensorboard" not in resolved["train"]


@pytest.mark.parametrize("train, message", [
    ({"tensorboard": False, "report_to": ["mlflow"]}, "train: tensorboard is replaced by report_to: remove tensorboard"),
    ({"report_to": ["none", "tensorboard"]}, "train: report_to: 'none' cannot be combined with trackers"),
    ({"report_to": ["tensorbord"]}, "train.report_to.0: Input should be 'tensorboard', 'wandb', 'mlflow'"),
])
def test_report_to_mistakes(tmp_path, train, message):
    proc = run_cli("validate", str(tiny_config(tmp_path, train=train)), check=False)
    assert proc.returncode == 2 and message in proc.stderr
