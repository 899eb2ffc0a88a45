"""Mixture-of-experts models from their config alone (torch-free): how many experts a layer routes each token to
(:func:`experts_of`), the router's auxiliary load-balancing loss a run adds (:func:`aux_coefficient`), and what the
``model`` section's expert keys need of the architecture (:func:`model_problems`).

transformers 5 runs every MoE layer's experts through one interface (``experts_implementation``: ``grouped_mm``,
its default where torch has ``grouped_mm``; ``eager``, a Python loop over the experts; ``batched_mm``, each token's
experts' weights gathered), and computes the Switch Transformer load-balancing loss of the router's logits
(``output_router_logits``, weighted by ``router_aux_loss_coef``) where the architecture has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig, ModelConfig

# The config keys architectures spell their routed experts per MoE layer with (Qwen3-MoE; Mixtral and gpt-oss;
# DeepSeek-V3).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts architecture's routing: ``count`` routed experts per MoE layer, each token sent to
    ``top_k``; ``aux_coef``: the config's ``router_aux_loss_coef`` (None: the architecture has no auxiliary loss
    in transformers)."""

    count: int
    top_k: int
    aux_coef: float | None


def experts_of(model_config: Any) -> Experts | None:
    """The routing of ``model_config``'s architecture (its text model's, for a multimodal one), or None for a dense
    model."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    count = next((getattr(text, key) for key in EXPERT_COUNT_KEYS if getattr(text, key, None)), None)
    if not count:
        return None
    return Experts(count=int(count), top_k=int(getattr(text, "num_experts_per_tok", 1) or 1),
                   aux_coef=getattr(text, "router_aux_loss_coef", None))


def aux_coefficient(model: "ModelConfig", model_config: Any) -> float:
    """The weight of the router's load-balancing loss in the training loss: ``model.router_aux_loss_coef`` where
    set, else the model config's; 0 for a dense model or an architecture without one."""
    experts = experts_of(model_config)
    if experts is None or experts.aux_coef is None:
        return 0.0
    given = model.router_aux_loss_coef
    return float(experts.aux_coef if given is None else given)


EXPERT_KEYS = ("experts_implementation", "router_aux_loss_coef")  # the model section's keys for MoE models


def sets_expert_keys(config: "HfsdpConfig") -> bool:
    return any(getattr(config.model, key) is not None for key in EXPERT_KEYS)


def model_problems(config: "HfsdpConfig", model_config: Any) -> list[tuple[str, str]]:
    """The ``model`` section's expert keys on an architecture that cannot take them: a dense model has no experts
    to run or router to balance; an architecture without an auxiliary loss in transformers (DeepSeek-V3 balances
    its experts with a bias in the router instead) has none to weigh."""
    model = config.model
    given = [key for key in EXPERT_KEYS if getattr(model, key) is not None]
    arch = getattr(model_config, "model_type", "this model")
    experts = experts_of(model_config)
    if experts is None:
        return [(f"model.{key}", f"{arch} is a dense model (no mixture-of-experts layers: none of "
                                 f"{', '.join(EXPERT_COUNT_KEYS)} in its config): remove model.{key}")
                for key in given]
    if model.router_aux_loss_coef and experts.aux_coef is None:
        return [("model.router_aux_loss_coef", f"{arch} has no auxiliary load-balancing loss in transformers (its "
                                               "config has no router_aux_loss_coef; its router balances itself): "
                                               "remove model.router_aux_loss_coef")]
    return []
