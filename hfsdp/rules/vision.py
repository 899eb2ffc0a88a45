"""What a vision-language model (a config with a ``vision_config``: :mod:`hfsdp.model.vision`) takes of the rest of
hfsdp so far, and what ``model.freeze`` needs, from the config and the architecture's config alone (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfsdp.rules.wrapping import precision_parts

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig

# The parts of a vision-language model ``model.freeze`` names (hfsdp.model.vision.part_of).
PARTS = ("vision", "projector", "language")


# The objectives a vision-language model trains with besides supervised fine-tuning: the preference objectives that
# read the pairs' completion log-probs of hfsdp.objective.PreferenceObjective's micro-batches (their pixel inputs
# included; not ORPO, whose NLL term covers the prompt, image tokens and all), and the online objectives that sample
# from prompts with images (hfsdp.builtin.online.sampling.sample_with_images; not on-policy distillation, whose
# teacher would need the images too).
IMAGE_OBJECTIVES = ("dpo", "simpo", "grpo", "rloo")
ONLINE_IMAGE_OBJECTIVES = ("grpo", "rloo")


# Architectures whose image features are cast to the dtype of the weights as stored (``.to(self.dtype)``), which
# FSDP's mixed precision leaves at model.dtype while the text's embeddings come out in the compute dtype.
CAST_TO_STORED_DTYPE = ("idefics2", "idefics3", "smolvlm")


def is_vision_language(model_config: Any) -> bool:
    """Whether the config is a vision-language model's (it has a vision tower's config)."""
    return getattr(model_config, "vision_config", None) is not None


def model_problems(config: "HfsdpConfig", facts: Any) -> list[tuple[str, str]]:
    """``model.freeze`` or ``data.image_max_pixels`` on a text-only model, a vision-language model with everything
    frozen and nothing else to train, and what vision-language training is not composed with yet (packing, tensor,
    context, sequence and expert parallelism, an objective other than :data:`IMAGE_OBJECTIVES`, 4-bit quantization).
    ``facts``: the model phase's (:class:`hfsdp.rules.table.Facts`); the model's config is read only where the
    config sets one of those."""
    freeze = list(config.model.freeze)
    parallel = [(f"parallel.{key}", f"without {what} parallelism so far: set parallel.{key}: 1 (FSDP shards it "
                                    "over every rank)")
                for key, what in (("tp_size", "tensor"), ("cp_size", "context"), ("sp_size", "sequence"),
                                  ("ep_size", "expert"))
                if getattr(config.parallel, key) > 1]
    enabled = facts.plugins.implementers("hfsdp_objective")
    objectives = [name for name in enabled if name not in IMAGE_OBJECTIVES]
    online = [(name, config.section(name)) for name in enabled if name in ONLINE_IMAGE_OBJECTIVES]
    limits = parallel + [
        *([("plugins", "without packing so far (a packed row's images and their position ids are not laid out yet): remove "
                       "packing from plugins")] if "packing" in config.plugins else []),
        *([("plugins", f"with supervised fine-tuning (data.format chat) or {', '.join(IMAGE_OBJECTIVES)} so far, not "
                       f"with {', '.join(objectives)}: remove it from plugins")] if objectives else []),
        *([("model.quantization", "without 4-bit quantization so far: remove model.quantization (LoRA on the full-precision "
                                  "model is built)")] if config.model.quantization is not None else []),
        *[(f"{name}.generation.engine", "sampling inline so far (the workers engine's processes do not read images "
                                        "yet): set generation.engine: inline")
          for name, section in online if section.generation.engine != "inline"],
        *[(f"{name}.tools", "with single-turn completions so far (rollouts that act do not show the model images "
                            "yet): remove the tools and environments") for name, section in online if section.acts],
    ]
    parts = precision_parts(config.fsdp)
    mixed = parts is not None and parts.param != config.model.dtype
    sized = config.data.image_max_pixels is not None
    if not freeze and not limits and not mixed and not sized:
        return []
    model_config = facts.model_config
    name = model_config.model_type
    if not is_vision_language(model_config):
        return ([("model.freeze", f"{name} is a text-only model: model.freeze names parts of a vision-language model "
                                  "(vision, projector, language); remove it")] if freeze else []) + \
            ([("data.image_max_pixels", f"{name} is a text-only model, which reads no image: remove "
                                        "data.image_max_pixels")] if sized else [])
    problems = []
    if set(freeze) >= set(PARTS) and not facts.plugins.trains_adapters(config):
        problems.append(("model.freeze", "every part is frozen and no adapter is trained: nothing would learn; "
                                         "leave a part out of model.freeze, or add LoRA (plugins: [lora])"))
    dims = facts.world.dims if facts.world is not None else None
    if freeze and dims is not None and dims.wrapper == "fsdp1" and dims.shard_group * dims.tp == 1:
        # torch's FSDP1 on a single shard leaves a frozen part's parameters out of the state dict it saves
        # ("FSDP assumes ... patch_embed.proj.weight is in the state_dict") at the first checkpoint.
        problems.append(("fsdp.version", "model.freeze under FSDP1 with a single shard (one process or NO_SHARD) hits "
                                         "a torch FSDP1 bug with frozen parameters at the first checkpoint: use "
                                         "fsdp.version: 2 (the default), or more than one rank"))
    if mixed and name in CAST_TO_STORED_DTYPE:
        problems.append(("fsdp.mixed_precision", f"{parts.param} with weights stored in {config.model.dtype}: "
                                                 f"transformers' {name} casts the image features to the dtype its "
                                                 "weights are stored in, while FSDP computes the text in "
                                                 f"{parts.param}, and the two cannot be merged; load the weights in "
                                                 f"it instead (model.dtype: {parts.param}, fsdp.mixed_precision: "
                                                 "no)"))
    return problems + [(key, f"{name} is a vision-language model, which hfsdp trains {how}") for key, how in limits]
