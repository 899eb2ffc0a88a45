"""hfsdp plugin for issue 56 part 4's measurements: every step's wall time and minor page faults, and optionally an
op-level profile (torch.profiler self CPU time per op, per step, and the callers of the elementwise ops), written at
train end to ``$STEP_PROFILE_OUT`` (JSON). Enable it with ``plugins: [step_profile]`` and this folder on PYTHONPATH:

    PYTHONPATH=benchmarks OMP_NUM_THREADS=1 hfsdp train benchmarks/peers.yaml --overwrite \\
        --set train.output_dir=/tmp/sp --set train.max_steps=8 --set "plugins=[step_profile]" \\
        --set train.log_every=1          # STEP_PROFILE_OUT=out.json; STEP_PROFILE_FROM=2: profile the steps after 2

A run with an (ignored) ``MALLOC_*`` variable set, e.g. ``MALLOC_BASELINE=1``, keeps glibc's own thresholds
(``hfsdp.run.heap`` leaves an environment that sets malloc alone): the baseline of the page faults' fix.
"""

import collections
import json
import os
import resource
import time

from hfsdp import hookimpl

__version__ = "0.0.1"

_state = {}
CALLERS_OF = ("aten::fill_", "aten::add", "aten::mul", "aten::copy_")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@hookimpl
def hfsdp_on_train_start(run):
    _state.update(faults_at=_faults(), t=time.perf_counter(), faults=[], times=[])


@hookimpl
def hfsdp_on_step_end(run, step, metrics):
    import torch

    now, faults = time.perf_counter(), _faults()
    _state["faults"].append(faults - _state["faults_at"])
    _state["times"].append(now - _state["t"])
    _state.update(faults_at=faults, t=now)
    start = os.environ.get("STEP_PROFILE_FROM")
    if start is not None and step == int(start):
        _state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        _state["profiler"].__enter__()
        _state["from"] = step


@hookimpl
def hfsdp_on_train_end(run, metrics):
    out = {"faults": _state["faults"], "step_times_s": _state["times"]}
    profiler = _state.pop("profiler", None)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        steps = run.state.step - _state["from"]
        ops = sorted(((e.key, e.self_cpu_time_total / 1e6 / steps, e.count / steps)
                      for e in profiler.key_averages()), key=lambda r: -r[1])
        callers, counts = collections.Counter(), collections.Counter()
        for e in profiler.events():
            if e.name in CALLERS_OF:
                chain, parent = [], e.cpu_parent
                while parent is not None and len(chain) < 4:
                    chain.append(parent.name)
                    parent = parent.cpu_parent
                key = " <- ".join([e.name, *chain])
                callers[key] += e.self_cpu_time_total / 1e6 / steps
                counts[key] += 1 / steps
        out.update(steps_profiled=steps, ops_s_per_step=ops[:60],
                   callers_s_per_step=sorted(((k, v, counts[k]) for k, v in callers.items()), key=lambda r: -r[1])[:40])
    with open(os.environ.get("STEP_PROFILE_OUT", run.output_dir / "step_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
