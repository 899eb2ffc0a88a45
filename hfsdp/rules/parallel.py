"""The rules of tensor and sequence parallelism from the config, the world and the model's config alone (torch-free):
what the config cannot combine with them, what the world and the model must allow.

Tensor parallelism has a 2-D layout (``dp_shard`` x ``tp``: FSDP2 over the data-parallel ranks, the architecture's
tensor-parallel plan inside each group of ``tp`` consecutive ranks); the plan applied is :func:`tp_plan`
(:mod:`hfsdp.parallel.tensor` applies it with torch's ``parallelize_module``). Sequence parallelism (``sp_size``,
DeepSpeed-Ulysses, :mod:`hfsdp.parallel.sequence`) splits each row's tokens over ``sp`` consecutive ranks and the
attention heads around attention; context parallelism (``cp_size``, ring attention, :mod:`hfsdp.parallel.ring`)
splits them over a ring whose ranks pass the keys and values around; FSDP (1 or 2) shards over every rank, as
torchtitan's ``dp_shard_cp``.

The embedding, the output head and the norms stay whole on the ranks of a tensor-parallel group (FSDP2 still shards
them over the data-parallel ranks), so that the chunked loss, the tied embeddings and the export see the model's own
tensors: the tensor-parallel plan splits the decoder layers' attention and MLP projections only.
"""

from __future__ import annotations

from typing import Any, TYPE_CHECKING

from hfsdp.layout.degrees import SPELLING_STRATEGIES
from hfsdp.rules.experts import experts_of

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.hooks.host import PluginHost


# The model's head counts a tensor- or sequence-parallel size must divide (each rank attends with its share).
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
ARTICLES = {"tp_size": "a", "sp_size": "an"}  # as the keys are read aloud ("a tp_size", "an sp_size")
# transformers' plan styles that torch's parallelize_module expresses as they are (the name: the torch style).
TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def config_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """What the ``parallel`` degrees cannot combine with, from the config alone (``hfsdp validate`` reports them):
    the data-parallel degrees given twice, tensor, sequence and expert parallelism's refusals."""
    return (degree_problems(config) + tp_config_problems(config) + split_config_problems(config, "cp_size")
            + split_config_problems(config, "sp_size") + ep_config_problems(config))


def degree_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """The data-parallel degrees given in two places: ``fsdp.sharding_strategy`` HYBRID_SHARD and NO_SHARD spell
    them (:mod:`hfsdp.layout.degrees`), so ``parallel.dp_replicate_size`` and ``dp_shard_size`` go with FULL_SHARD
    or SHARD_GRAD_OP."""
    strategy, parallel = config.fsdp.sharding_strategy, config.parallel
    given = [key for key, value in (("dp_replicate_size", parallel.dp_replicate_size != 1),
                                    ("dp_shard_size", parallel.dp_shard_size != -1)) if value]
    if strategy not in SPELLING_STRATEGIES or not given:
        return []
    spelled = "shards nothing, every data-parallel rank a replica" if strategy == "NO_SHARD" else \
        "shards within fsdp.hybrid_shard_size ranks and replicates across them"
    return [(f"parallel.{key}", f"fsdp.sharding_strategy {strategy} spells the data-parallel degrees itself (it "
                                f"{spelled}): give them in one place, FULL_SHARD (or SHARD_GRAD_OP) with "
                                f"parallel.{key}, or remove parallel.{key}") for key in given]


def tp_config_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    if config.parallel.tp_size == 1:
        return []
    fsdp, tp = config.fsdp, f"parallel.tp_size {config.parallel.tp_size}"
    problems = []
    if fsdp.version != 2:
        problems.append(("fsdp.version", f"{tp} composes with FSDP2 only (DTensor parameters on a 2-D mesh): set "
                                         "fsdp.version: 2"))
    if fsdp.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        problems.append(("fsdp.sharding_strategy", f"{fsdp.sharding_strategy} with {tp}: FSDP2 shards over the "
                                                   "data-parallel ranks with FULL_SHARD or SHARD_GRAD_OP; HYBRID_SHARD "
                                                   "and NO_SHARD are not composed with tensor parallelism yet"))
    refused = {
        "parallel.dp_replicate_size": (config.parallel.dp_replicate_size > 1,
                                       "replicas of a tensor-parallel model (HSDP x TP) are not composed yet"),
        "fsdp.cpu_offload": (fsdp.cpu_offload, "offloads FSDP's shards, not tensor-parallel ones"),
        "fsdp.cpu_ram_efficient_loading": (fsdp.cpu_ram_efficient_loading,
                                           "every rank reads the weights it splits (ranks > 0 would split empty ones)"),
        "model.quantization": (config.model.quantization is not None,
                               "bitsandbytes' 4-bit Linears cannot be split by torch's tensor-parallel styles"),
        "fsdp.wrap_policy": (fsdp.wrap_policy == "size", "the size policy is not composed with tensor parallelism: "
                                                         "use wrap_policy transformer"),
        # measured: torch 2.13 traced a compiled split block into a RecursionError (proxy_tensor) at the first backward
        "train.compile": (config.train.compile is not None, "torch 2.13 cannot yet trace the split blocks (a "
                                                            "RecursionError at the first backward)"),
    }
    problems += [(key, f"{why}: remove it, or set parallel.tp_size: 1") for key, (given, why) in refused.items()
                 if given]
    return problems


def objective_problems(config: "HfsdpConfig", plugins: "PluginHost") -> list[tuple[str, str]]:
    """A plugin's objective (``hfsdp_objective``) with ``tp_size``, ``cp_size`` or ``sp_size`` above 1: they
    split the next-token loss's model and rows only; refused from the config, before any data is read."""
    replacing = plugins.implementers("hfsdp_objective")
    return [(f"parallel.{key}", f"{', '.join(replacing)} (a plugin's objective) is not composed with {what} "
                                f"parallelism yet: next-token training only; set parallel.{key}: 1")
            for key, what in (("tp_size", "tensor"), ("cp_size", "context"), ("sp_size", "sequence"))
            if replacing and getattr(config.parallel, key) > 1]


# What splitting each row's tokens (parallel.cp_size: a ring; parallel.sp_size: Ulysses) is called, and what it
# exchanges inside a compiled block.
SPLITS = {"cp_size": ("context (ring attention)", "the ring's passes"), "sp_size": ("sequence", "the all-to-all")}


def split_config_problems(config: "HfsdpConfig", key: str) -> list[tuple[str, str]]:
    """What ``parallel.<key>`` (``cp_size`` or ``sp_size``) above 1 cannot combine with, from the config alone."""
    if getattr(config.parallel, key) == 1:
        return []
    fsdp, (what, exchanged) = config.fsdp, SPLITS[key]
    return _refused_beside(config, key, {
        "fsdp.sharding_strategy": (fsdp.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"),
                                   f"{fsdp.sharding_strategy} is not composed with {what} parallelism yet: FSDP "
                                   "shards over every rank with FULL_SHARD or SHARD_GRAD_OP"),
        "parallel.dp_replicate_size": (config.parallel.dp_replicate_size > 1,
                                       "replicas of split rows (HSDP with split rows) are not composed yet"),
        "parallel.tp_size": (config.parallel.tp_size > 1, f"tensor x {what} parallelism is not built yet: choose "
                                                          "one (tp splits the weights, this the activations)"),
        "model.attn_implementation": (config.model.attn_implementation != "sdpa",
                                      f"{config.model.attn_implementation} is not composed with {what} parallelism: "
                                      "use sdpa (torch's fused kernels, flash ones on GPUs)"),
        "train.compile": (config.train.compile is not None, f"compiled blocks with {exchanged} inside are not "
                                                            "tried yet"),
    })


def _refused_beside(config: "HfsdpConfig", degree: str, refused: dict[str, tuple[bool, str]]) -> list[tuple[str, str]]:
    """The problems of ``parallel.<degree>`` beside the keys of ``refused`` given (key -> (given, why))."""
    said = f"parallel.{degree} {getattr(config.parallel, degree)}"
    return [(key, f"{said}: {why}; or set parallel.{degree}: 1") for key, (given, why) in refused.items() if given]


def ep_config_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """What ``parallel.ep_size > 1`` cannot combine with, from the config alone: expert parallelism splits FSDP2's
    shard ranks (:mod:`hfsdp.parallel.expert_parallel`), whose rows must be their own."""
    ep = config.parallel.ep_size
    if ep == 1:
        return []
    fsdp = config.fsdp
    return _refused_beside(config, "ep_size", {
        "fsdp.version": (fsdp.version != 2, "expert parallelism needs FSDP2 (fsdp.version: 2): FSDP1 flattens each "
                                            "unit's parameters into one tensor and cannot hold experts split over "
                                            "ranks"),
        "fsdp.sharding_strategy": (fsdp.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"),
                                   f"{fsdp.sharding_strategy} is not composed with expert parallelism yet: FSDP2 "
                                   "shards over the data-parallel ranks with FULL_SHARD or SHARD_GRAD_OP"),
        "parallel.dp_replicate_size": (config.parallel.dp_replicate_size > 1,
                                       "replicas of an expert-parallel model (HSDP x EP) are not composed yet"),
        "parallel.tp_size": (config.parallel.tp_size > 1, "tensor x expert parallelism is not built yet (a "
                                                          "tensor-parallel group shares its rows)"),
        "parallel.sp_size": (config.parallel.sp_size > 1, "sequence x expert parallelism is not built yet"),
        "parallel.cp_size": (config.parallel.cp_size > 1, "context x expert parallelism is not built yet"),
        "fsdp.cpu_ram_efficient_loading": (fsdp.cpu_ram_efficient_loading,
                                           "every rank reads the weights and keeps its own experts"),
        "fsdp.cpu_offload": (fsdp.cpu_offload, "offloading split experts is not tried yet"),
        "fsdp.wrap_policy": (fsdp.wrap_policy == "size", "the size policy is not composed with expert "
                                                         "parallelism: use wrap_policy transformer"),
        "model.quantization": (config.model.quantization is not None,
                               "quantized experts are not split by expert parallelism"),
        "train.compile": (config.train.compile is not None, "compiled blocks with the token exchange inside (a host "
                                                            "sync per layer) are not tried yet"),
    })


def ep_model_problems(config: "HfsdpConfig", model_config: Any) -> list[tuple[str, str]]:
    """The architecture must be a mixture of experts with an expert-parallel plan (transformers'
    ``base_model_ep_plan``) and ``ep_size`` must divide each layer's experts."""
    ep = config.parallel.ep_size
    if ep == 1:
        return []
    arch = getattr(model_config, "model_type", "this model")
    experts = experts_of(model_config)
    if experts is None:
        return [("parallel.ep_size", f"{arch} is a dense model (no mixture-of-experts layers to split): set "
                                     "parallel.ep_size: 1")]
    if not ep_plan(model_config):
        return [("parallel.ep_size", f"{arch} declares no expert-parallel plan (base_model_ep_plan in transformers): "
                                     "set parallel.ep_size: 1")]
    if experts.count % ep:
        return [("parallel.ep_size", f"{ep} does not divide the model's {experts.count} experts per layer: choose "
                                     "an ep_size that does")]
    return []


def ep_plan(model_config: Any) -> dict[str, str]:
    """The architecture's expert-parallel plan (transformers' ``base_model_ep_plan``: base-model paths, ``*`` for the
    layer index, to a style); empty when it has none."""
    return dict(getattr(text_config(model_config), "base_model_ep_plan", None) or {})


def _undivided(key: str, size: int, model_config: Any, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """The model's counts ``names`` (its text config's) that ``size`` (``parallel.<key>``) does not divide."""
    text = text_config(model_config)
    ring = " (or parallel.cp_size, ring attention, which splits the positions and not the heads)"
    return [(f"parallel.{key}", f"{size} does not divide the model's {name} ({value}): choose {ARTICLES[key]} {key} "
                                "that does" + (ring if key == "sp_size" else ""))
            for name in names if isinstance(value := getattr(text, name, None), int) and value % size]


def tp_plan(model_config: Any) -> dict[str, str]:
    """The architecture's tensor-parallel plan (transformers' ``base_model_tp_plan``: module paths of the base model,
    ``*`` for the layer index, to a style name); empty when the architecture has none."""
    return dict(getattr(text_config(model_config), "base_model_tp_plan", None) or {})


def text_config(model_config: Any) -> Any:
    """The language model's part of ``model_config`` (a multimodal config's text config; else itself)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def model_problems(config: "HfsdpConfig", model_config: Any) -> list[tuple[str, str]]:
    """What the architecture must allow (checked once its config is read, before any weight loads): a plan whose
    styles hfsdp applies, and head counts and widths that ``tp_size`` divides; head counts that ``sp_size``
    divides (each rank of a sequence-parallel group attends with its share of the heads, and of the KV heads)."""
    sp = config.parallel.sp_size
    problems = _undivided("sp_size", sp, model_config, HEAD_COUNTS) if sp > 1 else []
    return problems + tp_model_problems(config, model_config) + ep_model_problems(config, model_config)


def tp_model_problems(config: "HfsdpConfig", model_config: Any) -> list[tuple[str, str]]:
    tp = config.parallel.tp_size
    if tp == 1:
        return []
    plan = tp_plan(model_config)
    arch = getattr(model_config, "model_type", "this model")
    if not plan:
        return [("parallel.tp_size", f"{arch} declares no tensor-parallel plan (base_model_tp_plan): set "
                                     "parallel.tp_size: 1")]
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        return [("parallel.tp_size", f"{arch}'s tensor-parallel plan uses {', '.join(unknown)}, which hfsdp does not "
                                     f"apply yet (it applies {', '.join(TP_STYLES)}): set parallel.tp_size: 1")]
    return _undivided("tp_size", tp, model_config, (*HEAD_COUNTS, "intermediate_size"))
