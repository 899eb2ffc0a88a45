"""Test-only hfsdp plugin that counts the collectives each optimizer step issues, by who issues them.

Enable it with ``plugins: [hfsdp_collectives]`` and this folder on PYTHONPATH. From ``hfsdp_on_train_start`` on,
every call of a ``torch.distributed`` collective is counted (the outermost one only: ``all_gather_object`` runs two
``all_gather``\\ s inside, which count as it) and attributed to FSDP (a frame of ``torch/distributed/fsdp`` on the
stack: its all-gathers and reduce-scatters, which a bare FSDP loop issues too) or else to the innermost frame of
hfsdp's own code outside its collective helpers (``module:function``, e.g. ``run.step:train_step``), with the wall
time of each of hfsdp's calls. Each rank appends one JSON line per step to ``<output_dir>/collectives_rank<R>.jsonl``:
``{"step": N, "fsdp": count, "hfsdp": {"issuer > collective": count}, "hfsdp_s": {"issuer > collective": seconds}}``,
the collectives since the previous step ended (so a step's line holds what ran after the previous step's log too:
eval, save polls, the preemption check).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from hfsdp import hookimpl

__version__ = "0.0.1"

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "reduce", "gather_object", "monitored_barrier",
               "all_gather_single", "reduce_scatter_single")  # (the last two: torch >= 2.13, FSDP2's)

_counts = {"fsdp": 0, "hfsdp": Counter(), "hfsdp_s": Counter()}
_depth = [0]
_out: dict[str, Path] = {}


def _who() -> str | None:
    """The issuer of the collective being called: None for FSDP's own (a frame of FSDP between the call and
    hfsdp's code), else the innermost frame of hfsdp's code outside its collective helpers
    (``hfsdp.parallel.world``), as ``module:function``."""
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/distributed/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
            return None
        name = frame.f_globals.get("__name__", "")
        if name.startswith("hfsdp.") and name != "hfsdp.parallel.world":
            return f"{name.removeprefix('hfsdp.')}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def _counting(name: str, original):
    def collective(*args, **kwargs):
        _depth[0] += 1
        key, t0 = None, time.perf_counter()
        try:
            if _depth[0] == 1:
                who = _who()
                if who is None:
                    _counts["fsdp"] += 1
                else:
                    key = f"{who} > {name}"
                    _counts["hfsdp"][key] += 1
            return original(*args, **kwargs)
        finally:
            _depth[0] -= 1
            if key is not None:  # the call's wall time (gloo's are synchronous: the wait for the other ranks too)
                _counts["hfsdp_s"][key] += time.perf_counter() - t0

    collective.__wrapped__ = original
    return collective


@hookimpl
def hfsdp_on_train_start(run):
    if not dist.is_initialized() or _out:
        return
    _out["path"] = Path(run.output_dir) / f"collectives_rank{run.world.rank}.jsonl"
    _out["path"].unlink(missing_ok=True)
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _counting(name, original))


@hookimpl
def hfsdp_on_step_end(run, step, metrics):
    if not _out:
        return
    with _out["path"].open("a") as f:
        f.write(json.dumps({"step": step, "fsdp": _counts["fsdp"], "hfsdp": dict(_counts["hfsdp"]),
                            "hfsdp_s": dict(_counts["hfsdp_s"])}) + "\n")
    _counts["fsdp"] = 0
    _counts["hfsdp"].clear()
    _counts["hfsdp_s"].clear()
