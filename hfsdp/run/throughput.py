"""Throughput, model FLOPs, MFU and memory of every training step (the math is pure functions; ``StepMeter`` only
keeps the per-step numbers for the end-of-run summary).

Model FLOPs of one optimizer step (docs/guide.md's "Per-step metrics" section says the same):

* weights: ``(4 * N + 2 * N_trainable) * tokens``. A token costs 2 FLOPs per weight in the forward pass, 2 more in
  the backward pass for the activation gradients, and 2 more for the weight gradients, which only trainable weights
  get: ``6 * N`` for full fine-tuning, about ``4 * N`` for LoRA. ``N`` counts every parameter except the input
  embedding table (a lookup, not a matmul); an output head tied to that table counts, once, as the matmul it is.
* attention: ``6 * layers * width * sum(length**2)`` over the rows of the step (``width`` = heads x head_dim). The
  score and value matmuls cost ``2 * width * length**2`` forward per layer for a row under a causal mask (half of
  the full square), and twice that backward. A packed row counts as one sequence.
* recomputation (activation checkpointing) is not counted: these are model FLOPs, the MFU convention, not the
  hardware's.

TFLOP/s and MFU are per device: the step's FLOPs divided by the world size and the step time, and that over the
device's peak dense FLOP/s at the precision the matmuls run in (``PEAK_TFLOPS``, or ``train.peak_tflops``).
"""

from __future__ import annotations

import re
import resource
import statistics
from dataclasses import dataclass, field
from typing import Any

from hfsdp.units import GIB, PRECISION_DTYPES


# Peak dense (no sparsity) TFLOP/s per device from NVIDIA's datasheets: (name, pattern matched against
# torch.cuda.get_device_name(), bf16, fp16, fp32). fp32 is the plain (non-TF32) rate, which is what fp32 matmuls
# run at under PyTorch's default (torch.backends.cuda.matmul.allow_tf32 = False). The first match wins.
PEAK_TFLOPS: tuple[tuple[str, str, float | None, float, float], ...] = (
    ("H200 NVL", r"H200 NVL", 835, 835, 60),
    ("H200 SXM", r"H200", 989, 989, 67),
    ("H100 NVL", r"H100 NVL", 835, 835, 60),
    ("H100 PCIe", r"H100 PCIe", 756, 756, 51),
    ("H100 SXM", r"H100", 989, 989, 67),
    ("A100", r"A100", 312, 312, 19.5),
    ("L40S", r"L40S", 362, 362, 91.6),
    ("L4", r"\bL4\b", 121, 121, 30.3),
    ("A10", r"\bA10\b", 125, 125, 31.2),
    ("V100 PCIe", r"V100-PCIE", None, 112, 14),
    ("V100 SXM2", r"V100", None, 125, 15.7),
)
_PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class FlopsModel:
    """What the FLOPs of a step depend on, counted once from the (unsharded) model."""

    params: int  # N: every parameter a token computes with but the input embedding table (a tied output head
    # counted once; of a mixture of experts' routed experts, the top_k of every layer's count a token is routed to)
    trainable: int  # the part of N that gets weight gradients
    layers: int
    attention_width: int  # heads x head_dim

    @classmethod
    def of(cls, model, model_config) -> "FlopsModel":
        from hfsdp.model import experts

        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is embedding
        unique = {id(p): p for p in model.parameters()}
        unique.pop(id(embedding), None)
        counted = experts.active_numel(model, model_config)
        params = round(sum(counted(p) for p in unique.values())) + (embedding.numel() if tied else 0)
        trainable = round(sum(counted(p) for p in unique.values() if p.requires_grad))
        trainable += embedding.numel() if tied and embedding.requires_grad else 0
        text = model_config.get_text_config()  # (a vision-language model's decoder; its tower is counted per token)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(params, trainable, text.num_hidden_layers, heads * head_dim)

    def attention_per_pair(self) -> float:
        """An attention (query, key) pair's FLOPs in a token's linear FLOPs (what packing weighs a wider row by)."""
        return 6 * self.layers * self.attention_width / (4 * self.params + 2 * self.trainable)

    def step_flops(self, tokens: float, sum_sq_lengths: float) -> float:
        """Model FLOPs of one step over ``tokens`` tokens in rows whose squared lengths sum to ``sum_sq_lengths``."""
        return (4 * self.params + 2 * self.trainable) * tokens + 6 * self.layers * self.attention_width * sum_sq_lengths


def tokens_and_square_lengths(batches: list[Any]) -> tuple[int, int]:
    """(tokens, sum of squared row lengths) of a step's micro-batches (``batches.MicroBatch``, counted on the host)."""
    lengths = [n for batch in batches for n in batch.lengths]
    return sum(lengths), sum(n * n for n in lengths)


def compute_precision(mixed_precision: str, model_dtype: str) -> str:
    """bf16/fp16/fp32: what the matmuls run in (FSDP's mixed precision if on, else the dtype the weights load in)."""
    if mixed_precision in PRECISION_DTYPES:
        return mixed_precision
    return {dtype: name for name, dtype in PRECISION_DTYPES.items()}.get(model_dtype, "fp32")


def peak_flops(device_name: str | None, precision: str, override_tflops: float | None = None) -> float | None:
    """Peak dense FLOP/s of one device: the override, else the table's entry for a known GPU, else None (no MFU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not device_name:
        return None
    for _, pattern, *peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            peak = peaks[_PRECISIONS.index(precision)]
            return peak * 1e12 if peak is not None else None
    return None


def step_rates(flops: float, tokens: float, seconds: float, world_size: int, peak: float | None) -> dict[str, float]:
    """tokens/s (global and per device), model TFLOP/s per device and, with a known peak, MFU in percent."""
    seconds = max(seconds, 1e-9)
    rates = {"tokens_per_s": tokens / seconds, "tokens_per_s_per_device": tokens / seconds / world_size,
             "tflops": flops / seconds / world_size / 1e12}
    if peak:
        rates["mfu_pct"] = 100 * flops / seconds / world_size / peak
    return rates


def memory(device) -> dict[str, float]:
    """This process's memory: on a GPU the peak allocated and reserved bytes since start; on CPU the current RSS and
    its peak (GiB)."""
    import torch

    if device.type == "cuda":
        return {"mem_max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "mem_max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB; updated lazily, hence max
    return {"mem_rss_gib": rss / GIB, "mem_peak_rss_gib": max(peak, rss) / GIB}


def peak_memory_gib(device) -> float:
    """The figure the summary reports per rank: peak allocated on a GPU, peak RSS on CPU."""
    stats = memory(device)
    return stats.get("mem_max_allocated_gib", stats.get("mem_peak_rss_gib", 0.0))


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Medians of the per-step rates, leaving out the first step when there are more (warm-up: allocator, caches)."""
    timed = steps[1:] if len(steps) > 1 else steps
    keys = [k for k in ("tokens_per_s", "tokens_per_s_per_device", "tflops", "mfu_pct") if timed and k in timed[0]]
    return {k: statistics.median(s[k] for s in timed) for k in keys}


def format_throughput(summary: dict[str, Any]) -> str:
    """One line: median tokens/s, TFLOP/s and MFU, and each rank's peak memory."""
    if "tokens_per_s" not in summary:
        return "throughput: no step ran"
    parts = [f"median {summary['tokens_per_s']:.0f} tokens/s ({summary['tokens_per_s_per_device']:.0f}/device)",
             f"{summary['tflops']:.3g} TFLOP/s/device"]
    if "mfu_pct" in summary:
        parts.append(f"MFU {summary['mfu_pct']:.1f}%")
    elif summary["memory_kind"] == "max allocated":  # a GPU missing from PEAK_TFLOPS
        parts.append("MFU unknown for this GPU (set train.peak_tflops)")
    peaks = ", ".join(f"{gib:.2f}" for gib in summary["peak_memory_gib_per_rank"])
    return f"throughput: {', '.join(parts)}; peak memory per rank ({summary['memory_kind']}): {peaks} GiB"


@dataclass
class StepMeter:
    """Per-step rates and memory for metrics.jsonl, the trackers and the progress bar; kept for the summary."""

    flops: FlopsModel
    world_size: int
    device: Any
    peak: float | None
    steps: list[dict[str, float]] = field(default_factory=list)

    def step(self, tokens: float, sum_sq_lengths: float, seconds: float) -> dict[str, float]:
        rates = step_rates(self.flops.step_flops(tokens, sum_sq_lengths), tokens, seconds, self.world_size, self.peak)
        self.steps.append(rates)
        return {**rates, **memory(self.device)}

    @classmethod
    def for_run(cls, flops: FlopsModel, config, accelerator) -> "StepMeter":
        import torch

        device = accelerator.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        precision = compute_precision(config.fsdp.precision_name, config.model.dtype)
        return cls(flops, accelerator.num_processes, device, peak_flops(name, precision, config.train.peak_tflops))

    @staticmethod
    def postfix(metrics: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows: tokens/s, MFU where known, and memory."""
        shown = {"tok_s": f"{metrics['tokens_per_s']:.0f}"}
        if "mfu_pct" in metrics:
            shown["mfu"] = f"{metrics['mfu_pct']:.1f}%"
        mem = metrics.get("mem_max_allocated_gib", metrics.get("mem_rss_gib"))
        shown["mem"] = f"{mem:.2f}G"
        return shown

    def summary(self, peak_memory_per_rank: list[float]) -> dict[str, Any]:
        return {**medians(self.steps), "peak_memory_gib_per_rank": peak_memory_per_rank,
                "memory_kind": "max allocated" if self.device.type == "cuda" else "peak RSS",
                "params_for_flops": self.flops.params, "trainable_params_for_flops": self.flops.trainable}
