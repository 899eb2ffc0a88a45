"""A mixture-of-experts model as a run trains it: loaded with the experts implementation and the router loss the
config asks for (:func:`configure`), and its routing watched (:class:`Router`).

:class:`Router` reads what each MoE layer's experts receive (transformers' experts modules all take
``(hidden_states, top_k_index, top_k_weights)``): the tokens each expert computed in the training forwards of a step
(not in evaluation, sampling, a reference's forward or an activation-checkpointing recompute), and the model's
load-balancing loss of each training forward, which :func:`hfsdp.run.step.train_step` adds to the loss weighted by
the coefficient (:func:`hfsdp.rules.experts.aux_coefficient`), averaged over the global batch's micro-batches as
transformers' ``Trainer`` averages it over gradient accumulation. Its metrics are over every rank's micro-batches:
``router/aux_loss`` (the loss before its weight), and per MoE layer ``router/imbalance/layer_<i>`` (the most tokens
an expert computed over the mean per expert: 1 is perfectly balanced, ``count / top_k`` the most a layer can be)
with their maximum ``router/imbalance``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from hfsdp.config.schema import HfsdpConfig, ModelConfig
from hfsdp.rules.experts import aux_coefficient, experts_of


def configure(model_config: Any, cfg: ModelConfig) -> tuple[Any, dict[str, Any]]:
    """``model_config`` as a run loads it, and the loading keyword arguments: for a mixture-of-experts model, the
    load-balancing loss's coefficient (:func:`~hfsdp.rules.experts.aux_coefficient`) where the architecture has
    one, the router's logits not returned by default (:class:`Router` asks for them in the training forwards
    only: sampling and evaluation never compute the loss, whose padding mask a decoding step's logits would not
    match), and ``model.experts_implementation`` where given; a dense model's config as it is."""
    experts = experts_of(model_config)
    if experts is None:
        return model_config, {}
    model_config = copy.deepcopy(model_config)
    model_config.output_router_logits = False
    if experts.aux_coef is not None:
        model_config.router_aux_loss_coef = aux_coefficient(cfg, model_config)
    return model_config, ({"experts_implementation": cfg.experts_implementation} if cfg.experts_implementation
                          else {})


def is_experts(module: torch.nn.Module) -> bool:
    """transformers' experts modules (``use_experts_implementation`` marks each instance)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def _routed(module: torch.nn.Module) -> bool:
    """An experts module, or one of peft's wrappers of its weights."""
    return is_experts(module) or (hasattr(module, "get_base_layer") and is_experts(module.get_base_layer()))


def routed_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of the routed experts' parameters (each token computes with ``top_k`` of a layer's experts:
    :func:`active_numel`), their LoRA adapters included (peft's wrappers of an experts module)."""
    return {id(p) for module in model.modules() if _routed(module) for p in module.parameters()}


def routed_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules of ``model`` by name, each as its layer calls it: the outermost of peft's wrappers of its
    weights where LoRA adapts them (their forward takes the layer's tokens and global expert ids; under expert
    parallelism the modules inside see the rank's tokens and local ids)."""
    found = [(name, module) for name, module in model.named_modules() if _routed(module)]
    return [(name, module) for name, module in found
            if not any(name.startswith(f"{outer}.") for outer, _ in found if outer != name)]


def active_numel(model: torch.nn.Module, model_config: Any):
    """``numel(p)``: the elements of ``model``'s parameter ``p`` a token computes with, ``top_k / count`` of a routed
    experts' parameter (:func:`routed_parameters`), all of any other."""
    routed, experts = routed_parameters(model), experts_of(model_config)
    share = experts.top_k / experts.count if experts is not None else 1.0

    def numel(p) -> float:
        return p.numel() * (share if id(p) in routed else 1)

    return numel


def _layer_index(name: str) -> int:
    """The decoder layer of an experts module's name (``model.layers.3.mlp.experts``: 3)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[-1]) if found else 0


def experts_report(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a run's mixture of experts runs, for the start-up report: experts per MoE layer (and on this rank,
    fewer where expert parallelism splits them), the experts each token is routed to, the MoE layers, the experts
    implementation transformers dispatches to and the load-balancing loss's weight (0: off); None for a dense
    model."""
    found = [module for module in model.modules() if is_experts(module)]
    if not found:
        return None
    config = found[0].config
    return {"experts": experts_of(config).count, "on_rank": found[0].num_experts,
            "top_k": getattr(config, "num_experts_per_tok", 1), "layers": len(found),
            "implementation": config._experts_implementation,
            "aux_coef": getattr(config, "router_aux_loss_coef", None) or 0.0}


def format_experts_report(report: dict[str, Any]) -> str:
    aux = (f"router load-balancing loss x {report['aux_coef']:g} (metrics router/aux_loss, router/imbalance)"
           if report["aux_coef"] else "no router load-balancing loss (metric router/imbalance)")
    split = (f", {report['on_rank']} on each rank (expert parallel over {report['experts'] // report['on_rank']} "
             "ranks)" if report["on_rank"] != report["experts"] else "")
    return (f"  experts: {report['experts']} per MoE layer, top {report['top_k']}, in {report['layers']} layers"
            f"{split} ({report['implementation']}) | {aux}")


class Router:
    """The routing of ``model``'s MoE layers in the training forwards of a step (module docstring), ``coefficient``
    the weight of its load-balancing loss. Hooks on the causal LM (``model``, or the model a peft wrapper wraps) and
    its experts modules; installed before the model is wrapped."""

    def __init__(self, model: torch.nn.Module, coefficient: float):
        self.coefficient = coefficient
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        found = [(_layer_index(name), module) for name, module in routed_modules(root)]
        self.layers = [index for index, _ in found]
        experts = found[0][1] if found else None
        self.experts = (experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts).num_experts \
            if experts is not None else 0
        self._counts: torch.Tensor | None = None
        self._training = False  # the causal LM's forward under way is a training one (autograd on)
        self._seen: set[int] = set()  # the MoE layers counted in it (a checkpointed layer's recompute is not)
        self._aux: list[torch.Tensor] = []  # the load-balancing losses of this micro-batch's training forwards
        self._aux_sum: torch.Tensor | float = 0.0  # (summed on the device: no host sync in the step's loop)
        self._aux_forwards = 0
        root.register_forward_pre_hook(self._forward_starts, with_kwargs=True)
        root.register_forward_hook(self._forward_ends)
        for position, (_, module) in enumerate(found):
            module.register_forward_pre_hook(self._counter(position), with_kwargs=True)

    @classmethod
    def of(cls, model: torch.nn.Module, config: HfsdpConfig, model_config: Any) -> "Router | None":
        """The router of ``model`` where it is a mixture of experts, else None."""
        if experts_of(model_config) is None:
            return None
        return cls(model, aux_coefficient(config.model, model_config))

    def _forward_starts(self, module, args, kwargs):
        self._training = torch.is_grad_enabled()
        self._seen.clear()
        if self._training and self.coefficient:  # the model computes its load-balancing loss of this forward
            return args, {**kwargs, "output_router_logits": True}
        return None

    def _forward_ends(self, module, args, output) -> None:
        aux = getattr(output, "aux_loss", None)
        if self._training and isinstance(aux, torch.Tensor):
            self._aux.append(aux)
        self._training = False

    def _counter(self, position: int):
        def count(module, args, kwargs) -> None:
            if not self._training or position in self._seen:
                return
            self._seen.add(position)
            chosen = args[1] if len(args) > 1 else kwargs["top_k_index"]
            if self._counts is None:
                self._counts = torch.zeros(len(self.layers), self.experts, dtype=torch.float64, device=chosen.device)
            self._counts[position] += torch.bincount(chosen.reshape(-1), minlength=self.experts)
        return count

    def start_step(self) -> None:
        """Forget what was counted before this step (a probe's forwards, the last step's)."""
        self._counts = None
        self._aux.clear()
        self._aux_sum, self._aux_forwards = 0.0, 0

    def take_loss(self, micro_batches: int) -> torch.Tensor | None:
        """The weighted load-balancing loss of the micro-batch just computed, as this rank's share of the global
        batch's (``micro_batches`` on this rank, as many on every data-parallel rank: FSDP's mean over the ranks
        then makes it the mean over the global batch's micro-batches); None without one."""
        if not self._aux:
            return None
        aux = torch.stack(self._aux).mean()
        self._aux.clear()
        self._aux_sum = self._aux_sum + aux.detach()
        self._aux_forwards += 1
        return aux * (self.coefficient / micro_batches)

    def sums(self) -> list[float]:
        """What this rank counted this step, to be summed over all ranks: the load-balancing losses' sum, their
        count, then the tokens of each MoE layer's experts (layer-major)."""
        counts = self._counts.flatten().tolist() if self._counts is not None else [0.0] * (
            len(self.layers) * self.experts)
        return [float(self._aux_sum), float(self._aux_forwards), *counts]

    def metrics_of(self, totals: list[float]) -> dict[str, float]:
        """The step's metrics (module docstring) from :meth:`sums` summed over all ranks."""
        aux_sum, forwards, *counts = totals
        metrics = {"router/aux_loss": aux_sum / forwards} if forwards else {}
        table = torch.tensor(counts, dtype=torch.float64).view(len(self.layers), self.experts)
        per_layer = {f"router/imbalance/layer_{index}": float(row.max() / row.mean())
                     for index, row in zip(self.layers, table) if row.sum() > 0}
        if per_layer:
            metrics["router/imbalance"] = max(per_layer.values())
        return {**metrics, **per_layer}
