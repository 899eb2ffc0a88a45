"""The plan's predicted peak for each point of ``hfsdp bench --sweep`` (run by bench in a child process, so that
bench's own process imports neither torch nor transformers): reads a JSON request on stdin, ``{"config": path or
null, "overrides": [...], "cache_dir": path, "on_cpu": bool, "points": [{"nproc": N, "strategy": S,
"overrides": [...]}, ...]}`` (``cache_dir``: where built-in models are built, the CLI's),
and writes one JSON object per point on stdout: the estimate's peak bytes per rank (``device_peak``) and its
``problem`` (None where the point can run).

    python -m hfsdp.tools.plan.points < request.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def predict(request: dict) -> list[dict]:
    from transformers.utils import logging as hf_logging

    from hfsdp.model.loading import architecture_config
    from hfsdp.rules.table import load_checked
    from hfsdp.tools.plan.estimate import setup_from_config
    from hfsdp.tools.plan.planner import Planner

    hf_logging.set_verbosity_error()
    cache_dir = Path(request["cache_dir"])
    planners: dict[tuple[str, ...], Planner] = {}  # one meta model and its traces per point's overrides
    out = []
    for point in request["points"]:
        overrides = (*request["overrides"], *point["overrides"])
        if overrides not in planners:
            cfg, _ = load_checked(request["config"], list(overrides))
            planners[overrides] = Planner(architecture_config(cfg.model.name_or_path, cfg.model, cache_dir), cfg,
                                          budget=1 << 60, cache_dir=cache_dir)
        planner = planners[overrides]
        setup = setup_from_config(planner.config, point["strategy"], point["nproc"], 1)
        if request["on_cpu"]:  # torch's AdamW loops over the parameters on CPU (one parameter's temporaries)
            setup = setup.changed(multi_tensor_adam=False)
        est = planner.estimate(setup)
        out.append({"device_peak": est.device_peak, "problem": est.problem})
    return out


def main() -> None:
    json.dump(predict(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
