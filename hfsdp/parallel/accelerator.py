"""The Accelerator for a run, and the model and optimizer it wraps as the run's ``RunSetup`` decided; the one
adaptation that lets FSDP run on CPU processes (rehearsal mode).

Accelerate only switches FSDP on for accelerator devices: on CPU processes (``torchrun`` + gloo) it silently
wraps the model in DDP instead (``AcceleratorState`` picks FSDP only in its GPU-like branch). Rehearsal mode sets the
state that branch would have set — distributed type FSDP, the plugin, and a plain ``cpu`` device (FSDP1 rejects
``cpu:0`` next to its own ``cpu`` compute device) — right after the Accelerator is built, before anything is
prepared. Two more pieces, both in :func:`build_accelerator`: the run's device mesh is attached for FSDP2 once the
type is FSDP (Accelerate refuses a mesh for MULTI_CPU), and in rehearsal mode FSDP1's full-state-dict gathers skip
their CPU offload, which on a CPU device frees the tensors it returns (:func:`_fsdp1_keep_cpu_gathers`).
``hfsdp.run.startup`` then proves at start-up that the model really ended up sharded.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hfsdp.model import loading
from hfsdp.config.schema import HfsdpConfig
from hfsdp.parallel.world import process_group_backend
from hfsdp.errors import UserError
from hfsdp.parallel.fsdp import build_fsdp_plugin
from hfsdp.parallel.mesh import device_mesh

if TYPE_CHECKING:
    from hfsdp.setup.decide import RunSetup


def build_accelerator(setup: "RunSetup", layer_classes: list[str]):
    """The Accelerator with exactly the distributed type the run's wrapper needs, or a UserError saying why not."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

    config, world = setup.config, setup.world
    plugin = build_fsdp_plugin(config.fsdp, layer_classes, world.dims) if setup.fsdp else None
    backend = process_group_backend(config, world)
    # FSDP casts through its mixed-precision policy; DDP has none, so it gets Accelerate's autocast instead.
    autocast = config.fsdp.precision_name if plugin is None else "no"
    rehearsal = world.on_cpu and plugin is not None
    accelerator = Accelerator(
        cpu=world.on_cpu,
        fsdp_plugin=plugin,
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
    if setup.wrapper == "fsdp2" and world.dims.splits_groups:
        _attach_mesh(AcceleratorState(), world.dims)
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


def _attach_mesh(state, dims) -> None:
    """The run's device mesh (:func:`hfsdp.parallel.mesh.device_mesh`) given to Accelerate with a data-parallel-only
    ParallelismConfig, so that its FSDP2 preparation shards over the mesh's ``dp_shard_cp`` dimension and replicates
    over ``dp_replicate`` (HSDP, its ``fsdp_dim_names``), and leaves the tensor- and sequence-parallel groups to
    hfsdp (:mod:`hfsdp.parallel.tensor` says why Accelerate's own TP path is not used; its SP is DeepSpeed's).
    Attached after the Accelerator is built: Accelerate validates a config passed to its constructor against the
    distributed type it picked (MULTI_CPU on CPU) and refuses it."""
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig(dp_replicate_size=dims.dp_replicate, dp_shard_size=dims.shard_group)
    config.device_mesh = device_mesh(dims, state.device.type)
    state.parallelism_config = config
    state.device_mesh = config.device_mesh


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


def fsdp1_drop_stale_gathers(model) -> int:
    """Free the gathered (unsharded) flat parameters that FSDP1 keeps allocated after loading a checkpoint while its
    parameters point at their shards again; returns how many. FSDP1 all-gathers a unit only when its gathered buffer
    is not allocated (``FlatParamHandle.needs_unshard``): after ``load_state`` the root unit's buffer stayed allocated,
    holding the weights as loaded, so the next forward used those, not the shards. A change to the weights after the
    load (schedule-free's ``train()``, which turns the saved averaged weights into the training sequence) was then
    not seen by the first resumed step (its loss 10.2277 instead of 10.2180 on the tiny model), though every shard,
    optimizer state and input was the uninterrupted run's. Freed, the next forward gathers the shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    freed = 0
    for module in FSDP.fsdp_modules(model):
        handle = module._handle
        if (handle is not None and handle.uses_sharded_strategy and handle.is_sharded(handle.flat_param)
                and not handle.needs_unshard()):
            handle.reshard(True)
            freed += 1
    return freed


def compile_blocks(model, config: HfsdpConfig) -> int:
    """``train.compile``: every transformer block (the FSDP layer classes) compiled in place (``module.compile()``,
    which keeps the module, its parameter names and the hooks FSDP2 adds later); returns how many. The blocks are
    all one class, so dynamo compiles one graph per input variant and every block reuses it. The rest of the model
    (embedding, final norm, the output head with its chunked loss) runs eagerly."""
    cfg = config.train.compile
    classes = set(loading.layer_classes(config.fsdp, model.config))
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
    needs; with ``parallel.tp_size`` its decoder layers split over the tensor-parallel ranks first, with
    ``parallel.ep_size`` its experts over the expert-parallel ranks (each experts module its own FSDP2 unit); activation
    checkpointing through transformers when no FSDP wrapper applies it; with ``train.compile`` the transformer blocks
    compiled in place first (:func:`compile_blocks`), so that FSDP2 shards compiled blocks and activation
    checkpointing recomputes them."""
    config = setup.config
    if config.fsdp.activation_checkpointing and not setup.fsdp:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if setup.world.dims.tp > 1:  # before compile (which traces the split layers) and FSDP2 (which shards the slices)
        from hfsdp.parallel.tensor import parallelize

        parallelize(model, accelerator.torch_device_mesh)
    if setup.world.dims.ep > 1:  # the experts' own FSDP2 units, before Accelerate's shard the rest
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from hfsdp.parallel.expert_parallel import parallelize_experts

        plugin = accelerator.state.fsdp_plugin
        parallelize_experts(model, accelerator.torch_device_mesh, setup.world.dims, {
            "reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()})
    if config.train.compile is not None:
        compile_blocks(model, config)
    if setup.wrapper == "fsdp1":
        # FSDP1 flattens parameters on wrap; an optimizer built before it would hold stale tensors. Its wrapped
        # parameters are 1-D views of each rank's shard, so which ones are matrices is read before.
        matrices = {name for name, p in model.named_parameters() if p.ndim >= 2}
        model = accelerator.prepare(model)
        return model, accelerator.prepare(build_optimizer(model, matrices))
    return accelerator.prepare(model, build_optimizer(model))


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
