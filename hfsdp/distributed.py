"""The Accelerator for a run, and the one adaptation that lets FSDP run on CPU processes (rehearsal mode).

Accelerate only switches FSDP on for accelerator devices: on CPU processes (``torchrun`` + gloo) it silently
wraps the model in DDP instead (``AcceleratorState`` picks FSDP only in its GPU-like branch). Rehearsal mode sets the
state that branch would have set — distributed type FSDP, the plugin, and a plain ``cpu`` device (FSDP1 rejects
``cpu:0`` next to its own ``cpu`` compute device) — right after the Accelerator is built, before anything is
prepared. Two more pieces, both in :func:`build_accelerator` and only in rehearsal mode: HYBRID_SHARD's
(replicate, shard) mesh is attached once the type is FSDP (Accelerate refuses a mesh for MULTI_CPU), and FSDP1's
full-state-dict gathers skip their CPU offload, which on a CPU device frees the tensors it returns
(:func:`_fsdp1_keep_cpu_gathers`). :func:`startup_report` then proves at start-up that the model really ended up
sharded, and every rank writes what it holds to ``<output_dir>/startup_rank<r>.json``.
"""

from __future__ import annotations

import contextlib
import json
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfsdp import __version__, models, quantization
from hfsdp.config import HfsdpConfig
from hfsdp.errors import UserError
from hfsdp.fsdp import FSDP_WRAPPERS, build_fsdp_plugin, build_parallelism_config, copies, hybrid_mesh_shape, wrapper
from hfsdp.units import MIB

# Options that need an accelerator device; rehearsal mode refuses them up front instead of crashing mid-run.
if TYPE_CHECKING:
    from hfsdp.run_setup import RunSetup

_GPU_ONLY = {
    "fsdp.cpu_offload": lambda c: c.fsdp.cpu_offload,
    "fsdp.version 1 with cpu_ram_efficient_loading": lambda c: c.fsdp.version == 1 and c.fsdp.cpu_ram_efficient_loading,
    "fsdp.version 1 with HYBRID_SHARD": lambda c: c.fsdp.version == 1 and c.fsdp.sharding_strategy == "HYBRID_SHARD",
    # Accelerate's FSDP1 plugin binds sync_module_states to the current CUDA device and raises without one.
    "fsdp.sync_module_states": lambda c: c.fsdp.version == 1 and bool(c.fsdp.sync_module_states),
    "train.compile.mode reduce-overhead / max-autotune (CUDA graphs)":
        lambda c: c.train.compile is not None and c.train.compile.cuda_graphs,
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


def process_group_backend(config: HfsdpConfig, world: World) -> str | None:
    """The torch.distributed backend hfsdp asks Accelerate for (None on CPU: Accelerate's gloo).

    FSDP with CPU offload, or gathering FULL_STATE_DICTs into host memory, runs collectives on CPU tensors, which
    NCCL cannot: those get ``cuda:nccl,cpu:gloo``. Accelerate derives the same from FSDP_* variables, which the CLI
    removes (the YAML decides), so it is requested explicitly here."""
    if world.on_cpu:
        return None
    cpu_collectives = config.fsdp.cpu_offload or config.fsdp.state_dict_type == "FULL_STATE_DICT"
    fsdp_wraps = wrapper(config.fsdp, world.size) in FSDP_WRAPPERS
    return "cuda:nccl,cpu:gloo" if cpu_collectives and fsdp_wraps else "nccl"


def runtime_env(config: HfsdpConfig, world: World) -> dict[str, str]:
    """Environment variables that torch needs for what the config asks, set by the CLI before CUDA starts:
    ``train.deterministic`` on CUDA needs a fixed cuBLAS workspace (torch raises on cuBLAS calls without it)."""
    return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if config.train.deterministic and not world.on_cpu else {}


def build_accelerator(setup: "RunSetup", layer_classes: list[str]):
    """The Accelerator with exactly the distributed type the run's wrapper needs, or a UserError saying why not."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

    config, world = setup.config, setup.world
    plugin = build_fsdp_plugin(config.fsdp, layer_classes) if setup.fsdp else None
    backend = process_group_backend(config, world)
    parallelism = build_parallelism_config(config.fsdp, world.size, world.local_size) if plugin is not None else None
    # FSDP casts through its mixed-precision policy; DDP has none, so it gets Accelerate's autocast instead.
    autocast = config.fsdp.precision_name if plugin is None else "no"
    rehearsal = world.on_cpu and plugin is not None
    accelerator = Accelerator(
        cpu=world.on_cpu,
        fsdp_plugin=plugin,
        # Accelerate validates a parallelism config against the distributed type it picked (MULTI_CPU on CPU) and
        # refuses it; rehearsal mode attaches the mesh below, once the type is FSDP.
        parallelism_config=None if rehearsal else parallelism,
        mixed_precision=autocast,
        gradient_accumulation_steps=1,  # hfsdp accumulates itself, normalising by the global token count
        # Trackers (train.report_to); those that keep local files (TensorBoard) write under <output_dir>/tensorboard.
        log_with=config.train.report_to or None,
        project_config=ProjectConfiguration(project_dir=config.train.output_dir,
                                            logging_dir=str(Path(config.train.output_dir) / "tensorboard")),
        step_scheduler_with_optimizer=False,
        # A rank that died or froze inside a collective fails the others after this long, not torch's 30 minutes.
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend,  # None on CPU: Accelerate's gloo
                                                timeout=timedelta(seconds=config.train.collective_timeout_s))],
    )
    if rehearsal:
        # AcceleratorState keeps its own copy of PartialState's dict: both must change (the Accelerator reads the
        # former, PartialState() calls elsewhere read the latter).
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        state.device = torch.device("cpu")
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["device"] = torch.device("cpu")
        if plugin.fsdp_version == 1:
            _fsdp1_keep_cpu_gathers()
            _fsdp1_copy_cpu_optimizer_gathers(plugin)
        if parallelism is not None:  # HYBRID_SHARD (FSDP2): the (replicate, shard) mesh, on gloo CPU groups
            state.parallelism_config = parallelism
            state.device_mesh = parallelism.get_device_mesh("cpu")
            parallelism._validate_accelerator(accelerator)
    if plugin is not None:
        expected = DistributedType.FSDP
    elif world.size == 1:  # the model runs as it is: no process group, no wrapper
        expected = DistributedType.NO
    else:
        expected = DistributedType.MULTI_CPU if world.on_cpu else DistributedType.MULTI_GPU
    if accelerator.distributed_type != expected:
        raise UserError(
            f"the launcher gave distributed type {accelerator.distributed_type.value}, but the config asks for "
            f"{expected.value} (fsdp.version {config.fsdp.version}, {config.fsdp.sharding_strategy}). Launch with "
            "`accelerate launch -m hfsdp train`, `torchrun -m hfsdp train`, or plain `hfsdp train`"
        )
    return accelerator


def _fsdp1_keep_cpu_gathers() -> None:
    """FSDP1 full state dicts (``get_state_dict``, FULL_STATE_DICT checkpoints) gather with ``offload_to_cpu``:
    ``FlatParamHandle.to_cpu`` copies the gathered flat parameter to the CPU and frees the original, which on a CPU
    compute device is the same storage, so the state dict reads freed memory (a segfault, or "setStorage ... out of
    bounds" with tied weights). Tensors already on the CPU need no offload: skip it there."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    if getattr(FlatParamHandle.to_cpu, "_hfsdp_cpu_noop", False):
        return
    offload = FlatParamHandle.to_cpu

    @contextlib.contextmanager
    def to_cpu(self):
        if self.flat_param.device.type == "cpu":
            yield
        else:
            with offload(self):
                yield

    to_cpu._hfsdp_cpu_noop = True
    FlatParamHandle.to_cpu = to_cpu


def _fsdp1_copy_cpu_optimizer_gathers(plugin) -> None:
    """FSDP1 gathers a full optimizer state (FULL_STATE_DICT checkpoints) into one buffer that it reuses for every
    state name (``_allgather_orig_param_states``), and copies each out with ``.cpu()`` when the config offloads to
    the CPU: on a CPU device that copy is the tensor itself, so Adam's ``exp_avg`` was saved holding
    ``exp_avg_sq``'s values. Without the offload FSDP clones each state instead; on a CPU device the offload
    means nothing else."""
    if getattr(plugin.optim_state_dict_config, "offload_to_cpu", False):
        plugin.optim_state_dict_config = replace(plugin.optim_state_dict_config, offload_to_cpu=False)


# What the start-up report adds to the strategy when FSDP does not wrap the model.
_WRAPPER_NOTES = {"ddp": " (runs as DDP)",
                  "none": " (one process: runs without a wrapper, nothing to shard; fsdp.single_process: fsdp keeps "
                          "FSDP)"}


def compile_blocks(model, config: HfsdpConfig) -> int:
    """``train.compile``: every transformer block (the FSDP layer classes) compiled in place (``module.compile()``,
    which keeps the module, its parameter names and the hooks FSDP2 adds later); returns how many. The blocks are
    all one class, so dynamo compiles one graph per input variant and every block reuses it. The rest of the model
    (embedding, final norm, the output head with its chunked loss) runs eagerly."""
    cfg = config.train.compile
    classes = set(models.layer_classes(config.fsdp, model.config))
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise UserError(f"train.compile: the model has no {', '.join(sorted(classes)) or 'transformer block'} "
                        "modules to compile; name its block class in fsdp.transformer_layer_cls")
    kwargs = {"backend": cfg.backend, **({"mode": cfg.mode} if cfg.mode else {})}
    for block in blocks:
        block.compile(**kwargs)
    return len(blocks)


def prepare_model_and_optimizer(accelerator, setup: "RunSetup", model, build_optimizer):
    """``model`` and ``build_optimizer(model)`` prepared by Accelerate (wrapped, sharded), in the order the wrapper
    needs; activation checkpointing through transformers when no FSDP wrapper applies it; with ``train.compile`` the
    transformer blocks compiled in place first (:func:`compile_blocks`), so that FSDP2 shards compiled blocks and
    activation checkpointing recomputes them."""
    config = setup.config
    if config.fsdp.activation_checkpointing and not setup.fsdp:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.train.compile is not None:
        compile_blocks(model, config)
    if setup.wrapper == "fsdp1":
        # FSDP1 flattens parameters on wrap; an optimizer built before it would hold stale tensors. Its wrapped
        # parameters are 1-D views of each rank's shard, so which ones are matrices is read before.
        matrices = {name for name, p in model.named_parameters() if p.ndim >= 2}
        model = accelerator.prepare(model)
        return model, accelerator.prepare(build_optimizer(model, matrices))
    return accelerator.prepare(model, build_optimizer(model))


def startup_report(setup: "RunSetup", accelerator, model) -> dict[str, Any]:
    config, world = setup.config, setup.world
    local, full = local_parameter_bytes(model)
    fsdp = config.fsdp
    mesh = hybrid_mesh_shape(fsdp, world.size, world.local_size)
    report = {
        "world_size": world.size,
        "distributed_type": accelerator.distributed_type.value,
        "process_group_backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
        "device": "cpu (rehearsal, gloo)" if world.on_cpu and accelerator.distributed_type.value != "NO"
                  else str(accelerator.device),
        "fsdp_version": fsdp.version,
        "strategy": fsdp.sharding_strategy + _WRAPPER_NOTES.get(setup.wrapper, "")
                    + (f" (replicate {mesh[0]} x shard {mesh[1]})" if mesh else ""),
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
    quant = quantization.settings(config)
    if quant is not None:
        report["quantized_base"] = quantization.base_report(model, quant)
        report["peak_rss_bytes_after_sharding"] = peak_rss_bytes()
    sharded = fsdp.sharding_strategy != "NO_SHARD" and setup.fsdp
    group = mesh[1] if mesh else world.size
    if sharded and group > 1 and local > 0.75 * full:
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
        + ("\n  checkpoints: asynchronous (staged into host memory, written in the background; complete once "
           "every rank's write is on disk)" if report.get("checkpoint_saves") == "asynchronous" else "")
        + (f"\n  torch.compile: {report['compiled_blocks']} transformer blocks compiled in place (the first steps "
           "compile them; metrics.jsonl compile_graphs counts the graphs)" if report.get("compiled_blocks") else "")
        + ("\n" + quantization.format_base_report(report["quantized_base"], report["peak_rss_bytes_after_sharding"])
           if "quantized_base" in report else "")
    )


def grad_scaler(setup: "RunSetup", accelerator):
    """The loss scaler fp16 needs (FSDP1's sharded one when FSDP1 wraps the model), registered for checkpointing
    after what the caller registered before; None for other precisions."""
    if setup.config.fsdp.precision_name != "fp16":
        return None
    if setup.wrapper == "fsdp1":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler()
    else:
        scaler = torch.amp.GradScaler(accelerator.device.type)
    accelerator.register_for_checkpointing(scaler)
    return scaler


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``tensor``: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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


def clip_grad_norm(accelerator, parameters: list[torch.Tensor], max_norm: float | None, config: HfsdpConfig,
                   world: World) -> torch.Tensor:
    """The total gradient norm over all ranks, after clipping the gradients to ``max_norm`` when it is set.

    Without clipping only the norm is computed (for the metrics and the non-finite check): torch's clip with an
    infinite bound would still multiply every gradient by 1. Under FSDP2 Accelerate's clip, which also reduces the
    sharded norms across ranks, does both. FSDP1's own clip (``FullyShardedDataParallel.clip_grad_norm_``, which
    Accelerate calls) misses part of the gradients when frozen and trainable parameters share a unit (LoRA: 0.713
    instead of 0.731 on the tiny model), so there the norm is summed here from each rank's gradient shards.
    """
    from accelerate.utils import DistributedType

    grads = [p.grad for p in parameters if p.grad is not None]
    if accelerator.distributed_type == DistributedType.FSDP and config.fsdp.version == 1:
        local = torch.nn.utils.get_total_norm(grads).double() if grads else torch.zeros((), dtype=torch.float64)
        squares = local.square().to(accelerator.device)
        torch.distributed.all_reduce(squares)
        total = (squares / copies(config.fsdp, world.size, world.local_size)).sqrt().float()
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total
    if max_norm is not None or accelerator.distributed_type == DistributedType.FSDP:
        return accelerator.clip_grad_norm_(parameters, max_norm or float("inf"))
    return torch.nn.utils.get_total_norm(grads)


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


def gather_objects(accelerator, value: Any) -> list[Any]:
    """Every rank's picklable ``value``, in rank order, on every rank."""
    if accelerator.num_processes == 1:
        return [value]
    values: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(values, value)
    return values


def per_rank(accelerator, value: float) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank."""
    values = [0.0] * accelerator.num_processes
    values[accelerator.process_index] = value
    return all_sum(accelerator, values)
