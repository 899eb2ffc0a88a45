"""Test-only hfsdp plugin: every rank appends its rank to ``<train.output_dir>/model_loads.txt`` when it is about to
load the model's weights (``hfsdp_before_model_load``), so that a test can tell whether a run got that far.

Enable it with ``plugins: [hfsdp_model_loads]`` and this folder on PYTHONPATH."""

from pathlib import Path

from hfsdp import hookimpl

__version__ = "0.0.1"


@hookimpl
def hfsdp_before_model_load(config, world):
    with open(Path(config.train.output_dir) / "model_loads.txt", "a") as log:
        log.write(f"{world.rank}\n")
