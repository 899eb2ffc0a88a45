"""Expert parallelism with transformers' own pieces: the architecture's expert-parallel plan
(:func:`hfsdp.rules.parallel.ep_plan`, ``base_model_ep_plan``) applied by ``apply_expert_parallelism`` over the run's
``ep`` mesh dimension (:func:`hfsdp.parallel.mesh.device_mesh`), then FSDP2 over ``efsdp`` for each experts module,
before Accelerate shards the rest over ``dp_shard_cp``.

Each rank of an ``ep`` group keeps 1/ep of every MoE layer's experts (a DTensor ``Shard(0)`` of the fused expert
weights: every rank loads the same weights and keeps its slice, no scatter), and its experts module sends each
(token, expert) pair to the expert's rank with an all-to-all and brings the outputs back with a second one
(``AllToAllEP``; gloo has all-to-all). The ranks of a group train on their own rows, so an expert's gradient holds the
contributions of ``ep`` ranks' rows: FSDP2 divides it by the data-parallel ranks (``dp_size``) instead of the
``efsdp`` ranks it reduces over, as transformers' ``apply_fully_sharded_data_parallelism`` and torchtitan do.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from hfsdp.rules.parallel import ep_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hfsdp.layout.degrees import ParallelDims


def _resolved(plan: dict[str, str], base) -> dict[str, str]:
    """The plan's ``*`` paths made the base model's own names (a DeepSeek-V3's dense first layers match none)."""
    names = [name for name, _ in base.named_modules()] + [name for name, _ in base.named_parameters()]
    resolved = {}
    for pattern, style in plan.items():
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        resolved.update({name: style for name in names if matcher.match(name)})
    return resolved


def parallelize_experts(model, mesh: "DeviceMesh", dims: "ParallelDims", fsdp_kwargs: dict) -> int:
    """Split ``model``'s experts over ``mesh["ep"]`` by its architecture's plan and shard each experts module over
    ``mesh["efsdp"]`` with FSDP2 (``fsdp_kwargs``: the rest of the model's ``fully_shard`` arguments), in place;
    returns how many experts modules. The plan and the counts are checked before any weight loads
    (:func:`hfsdp.rules.parallel.ep_model_problems`)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "base_model", base)  # the plan's paths start at the base model (Qwen3MoeModel)
    plan = _resolved(ep_plan(model.config), base)
    wrapped = [name for name, style in plan.items() if style == "ep_dispatch_experts"
               and not hasattr(base.get_submodule(name), "num_experts")]
    if wrapped:  # (a peft wrapper in the experts' place: refused from the config, lora.target_parameters)
        raise RuntimeError(f"expert parallelism: {wrapped[0]} is not transformers' experts module but a "
                           f"{type(base.get_submodule(wrapped[0])).__name__}")
    apply_expert_parallelism(base, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
    experts = [base.get_submodule(name) for name, style in plan.items() if style == "ep_dispatch_experts"]
    for module in experts:
        fully_shard(module, **{**fsdp_kwargs, "mesh": mesh["efsdp"]})
        # the gradient of an expert sums the rows of ep ranks: averaged over every data-parallel rank, as the rest
        module.set_gradient_divide_factor(float(dims.dp_size))
        if dims.efsdp > 1:
            # FSDP2 divides by another factor than the group's with PREMUL_SUM, which gloo refuses: sum, then divide
            module.set_force_sum_reduction_for_comms(True)
    return len(experts)
