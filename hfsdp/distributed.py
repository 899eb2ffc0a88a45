"""The Accelerator for a run, and the one adaptation that lets FSDP run on CPU processes (rehearsal mode).

Accelerate only switches FSDP on for accelerator devices: on CPU processes (``torchrun`` + gloo) it silently
wraps the model in DDP instead (``AcceleratorState`` picks FSDP only in its GPU-like branch). Rehearsal mode sets the
state that branch would have set — distributed type FSDP, the plugin, and a plain ``cpu`` device (FSDP1 rejects
``cpu:0`` next to its own ``cpu`` compute device) — right after the Accelerator is built, before anything is
prepared. :func:`check_sharded` then proves at start-up that the model really ended up sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfsdp.config import HfsdpConfig
from hfsdp.errors import UserError
from hfsdp.fsdp import build_fsdp_plugin, build_parallelism_config, runs_as_ddp

# Options that need an accelerator device; rehearsal mode refuses them up front instead of crashing mid-run.
_GPU_ONLY = {
    "fsdp.cpu_offload": lambda c: c.fsdp.cpu_offload,
    "fsdp.version 1 with cpu_ram_efficient_loading": lambda c: c.fsdp.version == 1 and c.fsdp.cpu_ram_efficient_loading,
    "fsdp.version 1 with HYBRID_SHARD": lambda c: c.fsdp.version == 1 and c.fsdp.sharding_strategy == "HYBRID_SHARD",
}


@dataclass
class World:
    rank: int
    size: int
    local_size: int
    on_cpu: bool


def rehearsal_problems(config: HfsdpConfig) -> list[tuple[str, str]]:
    return [
        (option, "needs a GPU; CPU rehearsal mode cannot run it (remove it for the rehearsal)")
        for option, applies in _GPU_ONLY.items() if applies(config)
    ]


def build_accelerator(config: HfsdpConfig, layer_classes: list[str], world: World):
    """The Accelerator with exactly the distributed type the config asks for, or a UserError saying why not."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    plugin = build_fsdp_plugin(config.fsdp, layer_classes)
    parallelism = build_parallelism_config(config.fsdp, world.size, world.local_size)
    # FSDP casts through its mixed-precision policy; DDP has none, so it gets Accelerate's autocast instead.
    autocast = config.fsdp.precision_name if plugin is None else "no"
    accelerator = Accelerator(
        cpu=world.on_cpu,
        fsdp_plugin=plugin,
        parallelism_config=parallelism,
        mixed_precision=autocast,
        gradient_accumulation_steps=1,  # hfsdp accumulates itself, normalising by the global token count
        log_with=None,
        step_scheduler_with_optimizer=False,
    )
    if world.on_cpu and plugin is not None:
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["device"] = torch.device("cpu")
    expected = DistributedType.FSDP if plugin is not None else (
        DistributedType.MULTI_CPU if world.on_cpu else DistributedType.MULTI_GPU
    )
    if accelerator.distributed_type != expected:
        raise UserError(
            f"the launcher gave distributed type {accelerator.distributed_type.value}, but the config asks for "
            f"{expected.value} (fsdp.version {config.fsdp.version}, {config.fsdp.sharding_strategy}). Launch with "
            "`accelerate launch -m hfsdp train`, `torchrun -m hfsdp train`, or plain `hfsdp train`, and do not "
            "set ACCELERATE_USE_DEEPSPEED / ACCELERATE_USE_MEGATRON_LM"
        )
    return accelerator


def is_ddp(config: HfsdpConfig) -> bool:
    return runs_as_ddp(config.fsdp)


def local_parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the full model)."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    flat_params = _fsdp1_flat_params(model)
    for p in model.parameters():
        full += p.numel() * p.element_size()  # a DTensor's numel is the global one
        if isinstance(p, DTensor):
            local += p.to_local().numel() * p.element_size()
        elif not flat_params:
            local += p.numel() * p.element_size()
    if flat_params:
        local = sum(fp.numel() * fp.element_size() for fp in flat_params)
        full = sum(
            sum(n * fp.element_size() for n in (s.numel() for s in fp._shapes)) for fp in flat_params
        )
    return local, full


def _fsdp1_flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]


def wrapped_units(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp2 = sum(isinstance(m, FSDPModule) for m in model.modules())
    return fsdp2 or len(FSDP.fsdp_modules(model))


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one tiny all-reduce)."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    torch.distributed.all_reduce(t)
    return bool(t.item() > 0)


def all_sum(accelerator, values: list[float]) -> list[float]:
    if accelerator.num_processes == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    torch.distributed.all_reduce(t)
    return t.tolist()
