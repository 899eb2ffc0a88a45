"""``bench_probe``: per-rank measurements for ``hfsdp bench``, written to ``<output_dir>/bench_rank<R>.json``.

Enabled by ``hfsdp bench`` (``plugins: [bench_probe]``); harmless but pointless in ordinary runs.

* bytes of parameters, gradients and optimizer state this rank holds, counted from live tensors: the local
  shard of each DTensor (FSDP2), the rank's views of FSDP1 flat parameters (``use_orig_params``), plain tensors
  (DDP); with ``model.quantization`` the 4-bit Linears' quant state too, and those Linears' own bytes
  (``quant_linear_bytes``) beside what they would take in bf16 on this rank (``quant_linear_bf16_bytes``).
  Gradients are counted right before the optimizer step (they are freed after it), optimizer state right after it;
* memory: on CUDA ``memory_allocated`` after prepare and ``max_memory_allocated`` during the steps; on CPU the
  resident set size (RSS) before the model is loaded, after it is loaded, after prepare, and its peak during the
  steps (the kernel's high-water mark, reset when training starts; a sampling thread where that reset is not
  allowed);
* the wall time of every loop iteration (one step-end hook to the next, so all of hfsdp's per-step work counts)
  and the tokens of each step;
* with ``bench_probe.activations: true``, the bytes autograd keeps for backward at the end of each forward, their
  peak over the steps (``saved_activations_peak``: the tensors the forward saved that are still alive, each base
  counted once, parameters left out; the loss's transients are freed by then): what ``hfsdp plan``'s
  ``activations`` predicts, counted the way its trace counts them;
* with ``bench_probe.profile: true`` (``hfsdp bench --profile``; CPU runs), where each iteration's time went, from a
  torch.profiler trace of the steps (:func:`split`): forward, backward, gradient clipping and the optimizer step
  (``hfsdp.run.step.phase`` labels them), FSDP's own hooks inside them (the all-gathers and reduce-scatters waited
  for, their copies in and out), the rest of the iteration, and apart from that sum the time a collective was in
  flight on the communication threads (concurrent with the phases where FSDP overlaps it). The profiler's own
  overhead slows the profiled steps.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

from hfsdp import hookimpl
from hfsdp.builtin.bench_probe.schema import BenchProbeSection
from hfsdp.tools.bench import SPLIT

_state: dict[str, Any] = {}
# The zero-length trace event the probe records at the start of training and at every step end: the steps' bounds.
STEP_MARK = "bench_probe.step_end"
# Trace events of FSDP's hooks (FSDP2: "FSDP::pre_forward (3)", ...; FSDP1: "FullyShardedDataParallel._pre_forward")
# and of collectives in flight (the communication threads' events: "gloo:all_gather", "nccl:all_reduce", ...).
FSDP_EVENTS = ("FSDP::", "FullyShardedDataParallel.")
COLLECTIVE_EVENTS = ("gloo:", "nccl:")


@hookimpl
def hfsdp_config_section():
    return "bench_probe", BenchProbeSection


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int | None:
    """The kernel's peak RSS (VmHWM) of this process, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give memory freed during loading and sharding back to the OS, so RSS after prepare means what it says."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _SavedActivations:
    """The bytes of the tensors autograd saved for backward that are alive (``torch.autograd.graph.
    saved_tensors_hooks`` for the steps), and their peak at the end of ``model``'s forwards. A tensor counts with
    its base (a view's storage counted once), parameters (FSDP's gathered ones too) left out, until the base is
    freed."""

    def __init__(self, model):
        import torch

        self.live = self.peak = 0
        self._counted: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._forward_end = model.register_forward_hook(self._at_forward_end)

    def _at_forward_end(self, module, args, output) -> None:
        self.peak = max(self.peak, self.live)

    def _pack(self, t):
        import weakref

        import torch

        base = t._base if t._base is not None else t
        key = id(base)
        parameter = isinstance(base, torch.nn.Parameter) or isinstance(t, torch.nn.Parameter)
        if not parameter and key not in self._counted:
            size = base.numel() * base.element_size()
            self._counted.add(key)
            self.live += size
            weakref.finalize(base, self._freed, key, size)
        return t

    def _freed(self, key: int, size: int) -> None:
        self._counted.discard(key)
        self.live -= size

    def close(self) -> None:
        self._hooks.__exit__(None, None, None)
        self._forward_end.remove()


class _Sampler(threading.Thread):
    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = _rss()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.peak = max(self.peak, _rss())


def _distinct(tensors) -> int:
    """Bytes of tensors, each storage counted once (FSDP1 views share their flat parameter's storage)."""
    from hfsdp.parallel.world import local_tensor  # here: `hfsdp plugins` loads this module without torch

    seen, total = set(), 0
    for t in tensors:
        t = local_tensor(t)
        if t is None or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@hookimpl
def hfsdp_before_model_load():
    # The pre-model baseline: torch, transformers and datasets imported, process group up, data prepared.
    _state["rss_before_load"] = _rss()


@hookimpl
def hfsdp_modify_model(model):
    from hfsdp.model import experts

    _state["rss_after_load"] = _rss()
    if experts.routed_parameters(model):  # a mixture of experts, whole before any wrapper: what a token computes with
        counted = experts.active_numel(model, model.config)
        _state["active_parameters"] = round(sum(counted(p) for p in model.parameters()))
    return None


@hookimpl
def hfsdp_on_train_start(run):
    import torch

    from hfsdp.parallel import quantized_base
    from hfsdp.rules import quantization
    from hfsdp.run.startup import local_parameter_bytes

    model, accelerator = run.model, run.accelerator
    cuda = accelerator.device.type == "cuda"
    local, full = local_parameter_bytes(model)
    fsdp = run.config.fsdp
    quant = quantization.settings(run.config)
    if quant is not None:  # QLoRA: the 4-bit Linears' quant state lives on the modules, beside the parameters
        base = quantized_base.base_report(model, quant)
        local += base["quant_state_bytes"]
        weights = 2 * base["packed_bytes_full"]  # two 4-bit weights per byte
        _state.update(quant_linear_bytes=base["packed_bytes_this_rank"] + base["quant_state_bytes"],
                      quant_linear_bf16_bytes=2 * weights // accelerator.num_processes)
    _state.update(
        rank=accelerator.process_index, world_size=accelerator.num_processes,
        device=str(accelerator.device), distributed_type=accelerator.distributed_type.value,
        model=run.config.model.name_or_path, strategy=fsdp.sharding_strategy, fsdp_version=fsdp.version,
        precision=fsdp.precision_name, param_dtype=run.config.model.dtype,
        parameters=full // (torch.finfo(getattr(torch, run.config.model.dtype)).bits // 8),
        param_bytes_full=full, param_bytes=local, grad_bytes=None, optim_bytes=None,
        steps=[], step_times_s=[], tokens=[], memory_kind="cuda_allocated" if cuda else "rss",
    )
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # Accelerate's wrapper holds the torch optimizer
    if optimizer is not None:
        def before_step(opt, args, kwargs):
            if _state["grad_bytes"] is None:
                _state["grad_bytes"] = _distinct(p.grad for g in opt.param_groups for p in g["params"]
                                                 if p.grad is not None)

        def after_step(opt, args, kwargs):
            if _state["optim_bytes"] is None:
                _state["optim_bytes"] = _distinct(v for s in opt.state.values() for v in s.values()
                                                  if isinstance(v, torch.Tensor) and v.dim() > 0)

        _state["hooks"] = [optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_step)]
    if cuda:
        torch.cuda.synchronize()
        _state["mem_after_prepare"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _malloc_trim()
        _state["mem_after_prepare"] = _rss()
        _state["hwm_reset"] = _reset_hwm()
        if not _state["hwm_reset"]:
            _state["sampler"] = _Sampler()
            _state["sampler"].start()
    if run.config.section("bench_probe").activations:
        _state["saved"] = _SavedActivations(model)
    if run.config.section("bench_probe").profile:
        if cuda:
            raise RuntimeError("bench_probe.profile splits CPU steps: on CUDA the host times its phases would "
                               "measure are kernel launches, not the kernels (not built)")
        _state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        _state["profiler"].__enter__()
        _mark()
    _state["t_last"] = time.perf_counter()


def _mark() -> None:
    import torch

    with torch.profiler.record_function(STEP_MARK):
        pass


@hookimpl
def hfsdp_on_step_end(run, step, metrics):
    if "profiler" in _state:
        _mark()
    now = time.perf_counter()
    _state["steps"].append(step)
    _state["step_times_s"].append(now - _state["t_last"])
    _state["tokens"].append(int(metrics.get("tokens", 0)))
    _state["t_last"] = now
    _state["mem_peak_steps"] = _peak()
    if "saved" in _state:
        _state["saved_activations_peak"] = _state["saved"].peak


def _peak() -> int:
    if _state["memory_kind"] == "cuda_allocated":
        import torch

        return torch.cuda.max_memory_allocated()
    if _state.get("hwm_reset"):
        return _hwm() or 0
    sampler = _state.get("sampler")
    return max(sampler.peak, _rss()) if sampler else _rss()


@hookimpl
def hfsdp_on_train_end(run):
    _write(run)


def split(events, iterations: list[float]) -> dict[str, list[float]]:
    """Each iteration's time (``iterations``, seconds, from step end to step end) by part (:data:`SPLIT`), from the
    profiler's ``events`` (``torch.autograd.profiler_util.FunctionEvent``; the :data:`STEP_MARK` events bound the
    iterations): the ``hfsdp.<phase>`` spans less the FSDP hooks inside them, those hooks (outermost ones only),
    ``other`` the rest of the iteration, and ``collectives`` the union of the intervals in which a collective was in
    flight, which overlaps the others."""
    import bisect

    from hfsdp.run.step import PHASES

    marks = sorted(e.time_range.start for e in events if e.name == STEP_MARK)
    n = min(len(marks) - 1, len(iterations))
    us = {part: [0.0] * n for part in SPLIT}
    flights: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    labels = {f"hfsdp.{p}": p for p in PHASES}

    def window(e) -> int | None:
        i = bisect.bisect_right(marks, e.time_range.start) - 1
        return i if 0 <= i < n else None

    for e in events:
        i = window(e)
        if i is None:
            continue
        if e.name in labels:
            us[labels[e.name]][i] += e.time_range.elapsed_us()
        elif e.name.startswith(COLLECTIVE_EVENTS):
            flights[i].append((e.time_range.start, min(e.time_range.end, marks[i + 1])))
        elif e.name.startswith(FSDP_EVENTS):
            parents, parent = [], e.cpu_parent
            while parent is not None:
                parents.append(parent.name)
                parent = parent.cpu_parent
            if any(name.startswith(FSDP_EVENTS) for name in parents):
                continue  # inside an outer FSDP hook, counted there
            us["fsdp_hooks"][i] += e.time_range.elapsed_us()
            phase = next((labels[name] for name in parents if name in labels), None)
            if phase is not None:
                us[phase][i] -= e.time_range.elapsed_us()
    for i, spans in enumerate(flights):
        end = float("-inf")
        for start, stop in sorted(spans):
            us["collectives"][i] += max(0.0, stop - max(start, end))
            end = max(end, stop)
    out = {part: [x / 1e6 for x in us[part]] for part in SPLIT}
    out["other"] = [iterations[i] - sum(out[p][i] for p in SPLIT if p not in ("other", "collectives"))
                    for i in range(n)]
    return out


def _write(run) -> None:
    profiler = _state.pop("profiler", None)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        _state["profile_s"] = split(profiler.events(), _state["step_times_s"])
    # mem_peak_steps was read at the last step end, so a final eval or export does not count.
    saved = _state.pop("saved", None)
    if saved is not None:
        saved.close()
    record = {k: v for k, v in _state.items() if k not in ("hooks", "sampler", "t_last")}
    record.setdefault("mem_peak_steps", _peak())
    record["rss_peak_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for handle in _state.get("hooks", []):
        handle.remove()
    if _state.get("sampler"):
        _state["sampler"].stop.set()
    path = Path(run.output_dir) / f"bench_rank{record['rank']}.json"
    path.write_text(json.dumps(record, indent=2))
