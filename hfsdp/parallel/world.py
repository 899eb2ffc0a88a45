"""The process group: the backend and the environment torch needs for what the config asks of the world
(:class:`World`, defined torch-free in :mod:`hfsdp.layout.degrees` with the run's degrees), and the collectives hfsdp
runs (all ranks call them: any_rank(s), all_sum, StartedSum, gather_objects, per_rank, the gradient norm).
"""

from __future__ import annotations

from typing import Any

import torch

from hfsdp.config.schema import HfsdpConfig
from hfsdp.layout.degrees import World


def process_group_backend(config: HfsdpConfig, world: World) -> str | None:
    """The torch.distributed backend hfsdp asks Accelerate for (None on CPU: Accelerate's gloo).

    FSDP with CPU offload, or gathering FULL_STATE_DICTs into host memory, runs collectives on CPU tensors, which
    NCCL cannot: those get ``cuda:nccl,cpu:gloo``. Accelerate derives the same from FSDP_* variables, which the CLI
    removes (the YAML decides), so it is requested explicitly here."""
    if world.on_cpu:
        return None
    cpu_collectives = config.fsdp.cpu_offload or config.fsdp.state_dict_type == "FULL_STATE_DICT"
    return "cuda:nccl,cpu:gloo" if cpu_collectives and world.dims.fsdp else "nccl"


def runtime_env(config: HfsdpConfig, world: World) -> dict[str, str]:
    """Environment variables that torch needs for what the config asks, set by the CLI before CUDA starts:
    ``train.deterministic`` on CUDA needs a fixed cuBLAS workspace (torch raises on cuBLAS calls without it)."""
    return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if config.train.deterministic and not world.on_cpu else {}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``tensor``: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def element_holders(tensor, world_size: int) -> int:
    """How many of the ``world_size`` ranks hold each element of the DTensor ``tensor``: the ranks outside its mesh
    (a data-parallel mesh of a tensor-parallel run leaves out the tp ranks, which hold the same) times its
    replicated mesh dimensions (HYBRID_SHARD's replicas)."""
    import math

    mesh = tensor.device_mesh
    # is_replicate, not "not is_shard": FSDP2 over a tensor-parallel column split is a _StridedShard, which is no
    # Shard (counting it as a replica made a tp2 x dp2 grad norm 5 % small)
    replicated = math.prod(mesh.size(i) for i, placement in enumerate(tensor.placements) if placement.is_replicate())
    return world_size // mesh.size() * replicated


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """A tensor's sum of squares in float64: of a matrix (2 or more dimensions), the float64 sum of its rows' float32
    norms squared (a row's norm is the same whichever rows a shard holds); of a flat tensor (FSDP1's flat shards,
    norms, biases), in float64. Over SmolLM2-135M's gradients on a 2-core CPU: 37 ms against 231 ms for casting
    every gradient to float64 and 41 ms for torch's ``clip_grad_norm_``, and 3e-9 relative from the all-float64 norm
    where torch's float32 one is 3.4e-5 off."""
    if g.dim() < 2:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square()
    rows = torch.linalg.vector_norm(g, dim=-1, dtype=None if g.dtype == torch.float32 else torch.float32)
    return rows.double().square().sum()


def clip_grad_norm(accelerator, parameters: list[torch.Tensor], max_norm: float | None, world: World,
                   summed_with: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """The total gradient norm over all ranks (float32), after clipping the gradients to ``max_norm`` when it is set,
    and ``summed_with`` (this rank's float64 values of the step, e.g. its loss sum) summed over all ranks in the same
    all-reduce as the norm's squares (one collective and one host sync for the step's sums).

    The same norm, bit for bit, whatever the ranks and their shards: each tensor's sum of squares is summed in
    float64 from what this rank holds (a DTensor's shard, FSDP1's flat shard, a whole gradient), over the ranks in
    float64 where FSDP shards the gradients (divided by how many ranks hold each element: a DTensor's
    :func:`element_holders`, which counts a tensor-parallel group's copies of what it does not split, else the
    replicas, ``world.dims.replicas``), and rounded to float32 once. The terms of that float64 sum are
    the norms of a matrix's rows (:func:`sum_of_squares`: taken in float32, the same values whichever rows a shard
    holds, as FSDP2 splits dimension 0) or a flat tensor's elements. Other orders of a float64 sum differ by about
    1e-16 relative, far below float32's 2**-24: one process and N ranks round to the same float32 norm (short of a
    tie, about one step in 1e8), so the clipping factor, and with it every clipped gradient, is the same. A
    float32 norm differed by 4e-6 relative
    between 1 process and 2 FSDP2 ranks of the tiny model (2.528125 and 2.528135), which an 8-bit optimizer state
    rounds into other codes (a weight 3.4e-4 off after 4 steps). Torch's own clip (and Accelerate's, which calls it)
    sums in float32 in the order of the shards. FSDP1's own clip also misses part of the gradients when frozen and
    trainable parameters share a unit (LoRA: 0.713 instead of 0.731 on the tiny model). Without ``max_norm`` only
    the norm is computed (for the metrics and the non-finite check)."""
    wrapped = world.dims.wrapper
    if wrapped != "fsdp1" and (max_norm is not None or wrapped == "fsdp2"):
        accelerator.unscale_gradients()  # what Accelerate's clip did first (its own fp16 scaler under DDP, if any)
    from torch.distributed.tensor import DTensor

    sharded = world.dims.fsdp and world.size > 1
    replicas = world.dims.replicas
    grads, squares = [], {}  # sums of squares by how many ranks hold each of their elements
    for p in parameters:
        if p.grad is None:
            continue
        holders = element_holders(p.grad, world.size) if isinstance(p.grad, DTensor) and sharded else replicas
        g = local_tensor(p.grad)
        grads.append(g)
        # every rank makes the same keys (the same parameters, the same meshes), also for an empty shard
        squares.setdefault(holders, torch.zeros((), dtype=torch.float64, device=accelerator.device))
        if g.numel():
            squares[holders] += sum_of_squares(g)
    extra = (summed_with if summed_with is not None else torch.zeros(0)).to(accelerator.device, torch.float64)
    if sharded:
        counts = sorted(squares)
        summed = torch.cat([torch.stack([squares[h] for h in counts]), extra])
        torch.distributed.all_reduce(summed)
        total = sum(summed[i] / h for i, h in enumerate(counts)).sqrt().float()
        extra = summed[len(counts):]
    else:  # whole gradients (one process; DDP's are already reduced): only the other values to sum over the ranks
        total = sum(squares.values(), torch.zeros((), dtype=torch.float64, device=accelerator.device)).sqrt().float()
        if accelerator.num_processes > 1 and extra.numel():
            torch.distributed.all_reduce(extra)
    if max_norm is not None:
        # torch.nn.utils.clip_grads_with_norm_'s factor, applied to what each rank holds
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():  # one multi-tensor kernel per device, as torch's clip
            torch._foreach_mul_(group, factor.to(device))
    return total, extra.tolist()


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one tiny all-reduce)."""
    return any_ranks(accelerator, [flag])[0]


def any_ranks(accelerator, flags: list[bool]) -> list[bool]:
    """Each of ``flags``: true on every rank if it is true on any rank (one all-reduce for all of them)."""
    if accelerator.num_processes == 1:
        return list(flags)
    t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=accelerator.device)
    torch.distributed.all_reduce(t)
    return [value > 0 for value in t.tolist()]


class StartedSum:
    """``values`` (floats) summed over all ranks by an all-reduce started now, which runs while this rank goes on;
    :meth:`result` waits for it (once). Collective: every rank starts it at the same point."""

    def __init__(self, accelerator, values: list[float]):
        self._values: list[float] | None = list(values)
        self._tensor = self._work = None
        if accelerator.num_processes > 1:
            self._tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
            self._work = torch.distributed.all_reduce(self._tensor, async_op=True)
            self._values = None

    def result(self) -> list[float]:
        if self._values is None:
            self._work.wait()
            self._values = self._tensor.tolist()
        return self._values


def all_sum(accelerator, values: list[float]) -> list[float]:
    return StartedSum(accelerator, values).result()


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
