"""Expert parallelism with transformers' own pieces: the architecture's expert-parallel plan
(:func:`hfsdp.rules.parallel.ep_plan`, ``base_model_ep_plan``) splits each MoE layer's experts over the run's ``ep``
mesh dimension (:func:`hfsdp.parallel.mesh.device_mesh`) and its experts module reaches them through transformers'
``AllToAllEP``; then FSDP2 shards each experts module over ``efsdp``, before Accelerate shards the rest over
``dp_shard_cp``.

Each rank of an ``ep`` group keeps 1/ep of every MoE layer's experts (a DTensor ``Shard(0)`` of the fused expert
weights: every rank loads the same weights and keeps its slice, no scatter), and its experts module sends each
(token, expert) pair to the expert's rank with an all-to-all and brings the outputs back with a second one (gloo has
all-to-all). The ranks of a group train on their own rows, so an expert's gradient holds the contributions of ``ep``
ranks' rows: FSDP2 divides it by the data-parallel ranks (``dp_size``) instead of the ``efsdp`` ranks it reduces
over, as transformers' ``apply_fully_sharded_data_parallelism`` and torchtitan do.

LoRA on the experts (peft's ``ParamWrapper`` of a fused expert weight, ``lora.target_parameters``) keeps every
expert's rank-r factors in one pair of matrices: ``lora_A`` ``(r x experts, in)``, expert-major rows, and ``lora_B``
``(out, r x experts)``, whose column ``k x experts + e`` is expert e's k-th. They stay whole on every rank of the ep
group (FSDP2 shards them over efsdp with the experts), in peft's layout, so that a checkpoint resumes at any ep size
and the export is peft's; a forward reads of them the rows and columns of the rank's experts, so that peft folds into
the rank's expert weights the factors of a peft layer of those experts alone. Their gradients are summed over the ep
group (each rank's only in its experts' rows and columns). The token exchange wraps the outermost peft wrapper.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from hfsdp.rules.parallel import ep_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hfsdp.layout.degrees import ParallelDims


def _experts_modules(plan: dict[str, str], base) -> dict[str, dict[str, str]]:
    """The base model's experts modules the plan dispatches to (its ``*`` paths made the model's names: a
    DeepSeek-V3's dense first layers match none), each with its weights' styles by name (``gate_up_proj``:
    ``grouped_gemm``)."""
    dispatched = [pattern for pattern, style in plan.items() if style == "ep_dispatch_experts"]
    found = {}
    for pattern in dispatched:
        weights = {path[len(pattern) + 1:]: style for path, style in plan.items() if path.startswith(f"{pattern}.")}
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        found.update({name: weights for name, _ in base.named_modules() if matcher.match(name)})
    return found


def _innermost(module):
    """transformers' experts module under peft's wrappers of its weights (itself where none wraps it), and the
    wrappers, outermost first."""
    wrappers = []
    while not hasattr(module, "_is_expert_parallel"):
        if not hasattr(module, "base_layer"):
            raise RuntimeError(f"expert parallelism: a {type(module).__name__} in the experts' place")
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def _split_adapters(wrapper, mesh: "DeviceMesh") -> dict[tuple[int, str], object]:
    """A peft wrapper's factors kept whole on every rank of the ep group (a DTensor ``Replicate`` there, which FSDP2
    shards as the rest of the experts module) and its expert count the rank's; returns, by (id of the module that
    holds it, its name), what a forward takes of each factor: its rows (``lora_A``) or columns (``lora_B``) of the
    rank's experts (module docstring)."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    size, rank = mesh.size(), mesh.get_local_rank()
    experts = wrapper.num_experts
    local = experts // size
    lo, hi = rank * local, (rank + 1) * local
    slices = {}
    for adapter in wrapper.lora_A:
        a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
        r = a.weight.shape[0] // experts
        for linear in (a, b):
            linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Replicate()],
                                                                 src_data_rank=None),
                                               requires_grad=linear.weight.requires_grad)
        slices[id(a), "weight"] = lambda w, r=r: w[lo * r:hi * r]
        slices[id(b), "weight"] = lambda w, r=r: w.view(w.shape[0], r, experts)[:, :, lo:hi].reshape(
            w.shape[0], r * local)
    wrapper.num_experts = local
    return slices


@contextlib.contextmanager
def _local_parameters(module, slices: dict[tuple[int, str], object]):
    """Every DTensor parameter under ``module`` as the rank's local tensor for the forward: the experts kernels and
    peft's factors compute on plain tensors. A frozen one is a Parameter (peft's parametrization of a base weight
    registers and restores it as one); a trained one the differentiable local view, whose gradient reaches the
    DTensor. An adapter's factor (``slices``) is its rank's experts' part of the whole, whose gradient is this
    rank's share of the sum over the ep group (``Partial``: FSDP2 sums it there before it reduces over efsdp)."""
    import torch
    from torch.distributed.tensor import DTensor, Partial

    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if (id(owner), name) in slices:
                local = slices[id(owner), name](param.to_local(grad_placements=[Partial()]))
            elif param.requires_grad:
                local = param.to_local()
            else:
                local = torch.nn.Parameter(param.to_local(), requires_grad=False)
            owner._parameters[name] = local
            swapped.append((owner, name, param))
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def _dispatch(outer, ep_mesh: "DeviceMesh", tp_mesh: "DeviceMesh", slices: dict[tuple[int, str], object]) -> None:
    """``outer`` (an experts module, or the outermost peft wrapper of one) reached through transformers' all-to-all
    exchange: its forward runs on the tokens routed to the rank's experts, with their local expert ids."""
    from transformers.distributed.expert_parallel import AllToAllEP

    exchange = AllToAllEP(outer, ep_mesh, tp_mesh)  # (reads outer's own forward and its expert count)

    def forward(hidden_states, top_k_index, top_k_weights):
        with _local_parameters(outer, slices):
            output = exchange(hidden_states, top_k_index, top_k_weights)
        return output.to(hidden_states.dtype)

    outer.forward = forward


def parallelize_experts(model, mesh: "DeviceMesh", dims: "ParallelDims", fsdp_kwargs: dict) -> int:
    """Split ``model``'s experts (and peft's adapters of them) over ``mesh["ep"]`` by its architecture's plan and
    shard each experts module over ``mesh["efsdp"]`` with FSDP2 (``fsdp_kwargs``: the rest of the model's
    ``fully_shard`` arguments), in place; returns how many experts modules. The plan and the counts are checked
    before any weight loads (:func:`hfsdp.rules.parallel.ep_model_problems`)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "base_model", base)  # the plan's paths start at the base model (Qwen3MoeModel)
    ep_mesh = mesh["ep"]
    modules = _experts_modules(ep_plan(model.config), base)
    for name, weights in modules.items():
        outer = base.get_submodule(name)
        experts, wrappers = _innermost(outer)
        for param, style in weights.items():  # the fused expert weights (and biases), Shard(0) over ep
            ALL_PARALLEL_STYLES[style].shard_param(experts, param, ep_mesh)
        slices = {}
        for wrapper in wrappers:
            slices.update(_split_adapters(wrapper, ep_mesh))
        _dispatch(outer, ep_mesh, mesh["tp"], slices)
        fully_shard(outer, **{**fsdp_kwargs, "mesh": mesh["efsdp"]})
        # the gradient of an expert sums the rows of ep ranks: averaged over every data-parallel rank, as the rest
        outer.set_gradient_divide_factor(float(dims.dp_size))
        if dims.efsdp > 1:
            # FSDP2 divides by another factor than the group's with PREMUL_SUM, which gloo refuses: sum, then divide
            outer.set_force_sum_reduction_for_comms(True)
    return len(modules)
