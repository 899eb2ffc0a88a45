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
  and the tokens of each step.
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

_state: dict[str, Any] = {}


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
    _state["rss_after_load"] = _rss()
    return None


@hookimpl
def hfsdp_on_train_start(run):
    import torch

    from hfsdp.model import quantized
    from hfsdp.rules import quantization
    from hfsdp.run.startup import local_parameter_bytes

    model, accelerator = run.model, run.accelerator
    cuda = accelerator.device.type == "cuda"
    local, full = local_parameter_bytes(model)
    fsdp = run.config.fsdp
    quant = quantization.settings(run.config)
    if quant is not None:  # QLoRA: the 4-bit Linears' quant state lives on the modules, beside the parameters
        base = quantized.base_report(model, quant)
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
    _state["t_last"] = time.perf_counter()


@hookimpl
def hfsdp_on_step_end(run, step, metrics):
    now = time.perf_counter()
    _state["steps"].append(step)
    _state["step_times_s"].append(now - _state["t_last"])
    _state["tokens"].append(int(metrics.get("tokens", 0)))
    _state["t_last"] = now
    _state["mem_peak_steps"] = _peak()


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


def _write(run) -> None:
    # mem_peak_steps was read at the last step end, so a final eval or export does not count.
    record = {k: v for k, v in _state.items() if k not in ("hooks", "sampler", "t_last")}
    record.setdefault("mem_peak_steps", _peak())
    record["rss_peak_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for handle in _state.get("hooks", []):
        handle.remove()
    if _state.get("sampler"):
        _state["sampler"].stop.set()
    path = Path(run.output_dir) / f"bench_rank{record['rank']}.json"
    path.write_text(json.dumps(record, indent=2))
