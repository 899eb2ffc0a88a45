"""examples/: every config is valid, resolves offline to a shipped architecture config, and `hfsdp plan` says it
fits the hardware its comment names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import CACHE_DIR, REPO, base_env, run_cli

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
HARDWARE = re.compile(r"^# hardware: (\d+) nodes? x (\d+) GPUs? x (\d+) GiB", re.M)


def test_examples_cover_sizes_methods_and_data_formats():
    configs = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
    models = " ".join(c["model"]["name_or_path"] for c in configs)
    for size in ("0.5B", "1B", "3B", "70B"):
        assert f"-{size}" in models, size
    assert len(re.findall(r"-[78]B", models)) >= 2
    assert {c["data"]["format"] for c in configs} == {"chat", "instruction"}
    assert {"lora" in c.get("plugins", []) for c in configs} == {True, False}
    for path in EXAMPLES:
        text = path.read_text()
        assert HARDWARE.search(text) and "# Why these FSDP settings:" in text, path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_and_fits_the_hardware_in_its_comment(path: Path):
    from hfsdp.rules.table import load_checked
    from hfsdp.model.loading import architecture_config
    from hfsdp.tools.plan.planner import Planner, plan
    from hfsdp.units import GIB

    nodes, gpus, gib = map(int, HARDWARE.search(path.read_text()).groups())
    run_cli("validate", str(path), env=base_env(HF_HUB_OFFLINE="1"))
    config, _ = load_checked(str(path))
    planner = Planner(architecture_config(config.model.name_or_path, config.model, CACHE_DIR), config, gib * GIB)
    (row,) = plan(planner, [config.fsdp.sharding_strategy], [gpus], nodes)
    assert row.problem is None and row.fits, (
        f"{path.name}: predicted {row.device_peak / GIB:.1f} GiB per GPU, over the {gib} GiB its comment names")
