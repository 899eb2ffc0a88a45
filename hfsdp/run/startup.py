"""The start-up report: what wraps the model and what each rank holds of it, counted from live tensors (DTensor
local shards, FSDP1 flat parameters), printed by the main process and written by every rank to
``<output_dir>/startup_rank<r>.json``; a model that did not end up sharded stops the run here.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch

from hfsdp import __version__
from hfsdp.errors import UserError
from hfsdp.model import experts
from hfsdp.parallel import quantized_base
from hfsdp.parallel.world import local_tensor
from hfsdp.rules import quantization
from hfsdp.units import MIB


if TYPE_CHECKING:
    from hfsdp.setup.decide import RunSetup


# What the start-up report adds to the strategy when FSDP does not wrap the model.
_WRAPPER_NOTES = {"ddp": " (runs as DDP)",
                  "none": " (one process: runs without a wrapper, nothing to shard; fsdp.single_process: fsdp keeps "
                          "FSDP)"}


def startup_report(setup: "RunSetup", accelerator, model) -> dict[str, Any]:
    config, world = setup.config, setup.world
    local, full = local_parameter_bytes(model)
    fsdp = config.fsdp
    dims = world.dims
    report = {
        "world_size": world.size,
        "distributed_type": accelerator.distributed_type.value,
        "process_group_backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
        "device": "cpu (rehearsal, gloo)" if world.on_cpu and accelerator.distributed_type.value != "NO"
                  else str(accelerator.device),
        "fsdp_version": fsdp.version,
        "strategy": fsdp.sharding_strategy + _WRAPPER_NOTES.get(setup.wrapper, "")
                    + (f" (replicate {dims.dp_replicate} x shard {dims.dp_shard})" if dims.hybrid else "")
                    + (f" over dp_shard {dims.dp_size} x tensor parallel {dims.tp}" if dims.tp > 1 else "")
                    + (f" over dp {dims.dp_size} x " + " x ".join(
                        f"{what} parallel {size}" for what, size in (("context", dims.cp), ("sequence", dims.sp))
                        if size > 1) if dims.token_split > 1 else "")
                    + (f" over dp {dims.dp_size}, experts over expert parallel {dims.ep} x efsdp {dims.efsdp}"
                       if dims.ep > 1 else ""),
        "tp_size": dims.tp,
        "cp_size": dims.cp,
        "sp_size": dims.sp,
        "ep_size": dims.ep,
        "wrap_policy": fsdp.wrap_policy,
        "wrapped_units": wrapped_units(model),
        "wrapped_unit_names": wrapped_unit_names(model),
        "checkpointed_layers": checkpointed_layers(model),
        "compiled_blocks": sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()),
        "mixed_precision": fsdp.precision_name,
        "param_bytes_this_rank": local,
        "param_bytes_full_model": full,
        "checkpoint_saves": "asynchronous" if config.train.async_save else "synchronous",
    }
    moe = experts.experts_report(model)
    if moe is not None:
        report["experts"] = moe
    quant = quantization.settings(config)
    if quant is not None:
        report["quantized_base"] = quantized_base.base_report(model, quant)
        report["peak_rss_bytes_after_sharding"] = peak_rss_bytes()
    if setup.fsdp and dims.dp_shard > 1 and local > 0.75 * full:  # dp_shard: the ranks FSDP shards over
        raise UserError(
            f"the model did not end up sharded: this rank holds {local} of {full} parameter bytes under "
            f"{fsdp.sharding_strategy} on {world.size} ranks. This is a bug in the launcher adaptation; "
            "please report it with the output of `hfsdp train --help` and your launcher command"
        )
    return report


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def write_rank_report(output_dir: Path, rank: int, report: dict[str, Any]) -> None:
    """Every rank's own startup numbers (what it holds, its peak RSS so far), as ``<output_dir>/startup_rank<r>.json``."""
    peak_rss = peak_rss_bytes()
    report.setdefault("peak_rss_bytes_after_sharding", peak_rss)
    (output_dir / f"startup_rank{rank}.json").write_text(
        json.dumps({"rank": rank, **report, "peak_rss_bytes": peak_rss}, indent=2))


def report_startup(setup: "RunSetup", accelerator, model, output_dir: Path) -> dict[str, Any]:
    """:func:`startup_report`, printed (main process) and written by every rank (:func:`write_rank_report`)."""
    report = startup_report(setup, accelerator, model)
    accelerator.print(format_report(report))
    write_rank_report(output_dir, setup.world.rank, report)
    return report


def report_optimizer_state(report: dict[str, Any], optimizer, output_dir: Path, rank: int) -> None:
    """Add the optimizer state's bytes to the rank's report once it exists (after the first applied step)."""
    if "optimizer_state_bytes_this_rank" not in report:
        report["optimizer_state_bytes_this_rank"] = optimizer_state_bytes(optimizer)
        write_rank_report(output_dir, rank, report)


# What wraps the model, by Accelerate's distributed type, in the start-up line.
_WRAPPER_WORDS = {"NO": "no wrapper", "FSDP": "FSDP", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}


def runs_on(report: dict[str, Any]) -> str:
    """What runs, in words: "1 process on cpu, no wrapper", "2 processes on cpu (rehearsal, gloo), FSDP"."""
    n = report["world_size"]
    wrapper = _WRAPPER_WORDS.get(report["distributed_type"], report["distributed_type"])
    return f"{n} process{'' if n == 1 else 'es'} on {report['device']}, {wrapper}"


def format_report(report: dict[str, Any]) -> str:
    return (
        f"hfsdp {__version__} | {runs_on(report)}\n"
        f"  FSDP{report['fsdp_version']} {report['strategy']} | wrap {report['wrap_policy']} "
        f"({report['wrapped_units']} units) | mixed precision {report['mixed_precision']}\n"
        f"  parameters on this rank: {report['param_bytes_this_rank'] / MIB:.1f} MiB of "
        f"{report['param_bytes_full_model'] / MIB:.1f} MiB "
        f"({100 * report['param_bytes_this_rank'] / max(1, report['param_bytes_full_model']):.0f}%)"
        + ("\n" + experts.format_experts_report(report["experts"]) if "experts" in report else "")
        + ("\n  checkpoints: asynchronous (staged into host memory, written in the background; complete once "
           "every rank's write is on disk)" if report.get("checkpoint_saves") == "asynchronous" else "")
        + (f"\n  torch.compile: {report['compiled_blocks']} transformer blocks compiled in place (the first steps "
           "compile them; metrics.jsonl compile_graphs counts the graphs)" if report.get("compiled_blocks") else "")
        + ("\n" + quantized_base.format_base_report(report["quantized_base"], report["peak_rss_bytes_after_sharding"])
           if "quantized_base" in report else "")
    )


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor``."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def local_parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the full model)."""
    flat_params = _fsdp1_flat_params(model)
    if flat_params:  # FSDP1: each flat parameter is this rank's shard of the original parameters it records
        local = sum(_local_bytes(fp) for fp in flat_params)
        full = sum(s.numel() * fp.element_size() for fp in flat_params for s in fp._shapes)
        return local, full
    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the global one
    return sum(_local_bytes(p) for p in params), full


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state (e.g. Adam moments) this rank holds: sharded with the parameters under FSDP."""
    return sum(
        _local_bytes(value)
        for per_param in getattr(optimizer, "optimizer", optimizer).state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )


def _fsdp1_flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]


def wrapped_units(model: torch.nn.Module) -> int:
    # One fully_shard call on several modules (Accelerate groups final norm, embedding and lm_head) is one unit.
    return len(wrapped_unit_names(model))


def wrapped_unit_names(model: torch.nn.Module) -> list[str]:
    """The FSDP units, each named by the module(s) it wraps (``<root>`` for the model itself; one FSDP2 group of
    several modules as ``a+b``), in module order. Wrapper levels (FSDP1's ``_fsdp_wrapped_module``, checkpoint
    wrappers) are left out of the names, so they read as the model's own module names (as ``hfsdp plan`` lists
    them)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def clean(name: str) -> str:
        parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")]
        return ".".join(parts) or "<root>"

    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups.setdefault(id(module._get_fsdp_state()), []).append(clean(name))
        elif isinstance(module, FSDP):
            groups.setdefault(id(module), []).append(clean(name))
    return ["+".join(dict.fromkeys(names)) for names in groups.values()]


def checkpointed_layers(model: torch.nn.Module) -> int:
    """Layers whose activations are recomputed in backward: FSDP's checkpoint wrappers (Accelerate applies them for
    fsdp.activation_checkpointing) or transformers' gradient checkpointing (the DDP path)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(isinstance(m, CheckpointWrapper) or (isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)
               for m in model.modules())
