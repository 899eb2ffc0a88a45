"""Vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5, SmolVLM/Idefics3, Gemma 3, LLaVA, ...): what hfsdp
needs to know of their three parts, and their processor.

A model is vision-language when its config has a ``vision_config``; transformers then builds it with
``AutoModelForImageTextToText`` (the ``...ForConditionalGeneration`` class), never the causal-LM class, even for a
text-only fine-tune of an early-fusion model. Its parameters belong to one of three parts, named by where they lie in
the module tree (each family names them its own way; the patterns below cover transformers' names):

* ``projector``: what maps the vision tower's features to the language model's width (``multi_modal_projector``,
  Idefics3's ``connector``, Qwen's ``visual.merger`` and Qwen3-VL's ``deepstack_merger_list``);
* ``vision``: the rest of the vision tower (``visual``, ``vision_tower``, ``vision_model``);
* ``language``: everything else (the decoder, its embeddings and the output head).

``model.freeze`` freezes any of them (:func:`freeze`), and FSDP wraps each part's blocks, the projector and the
tower as units of their own (:func:`wrap_classes`), so no unit holds two parts but the root (the language model's
embeddings, final norm and head).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from hfsdp.data.images import PROCESSOR_ATTR, TOWER_PLACEHOLDER
from hfsdp.rules.vision import is_vision_language

# The parts other than the language model, in the order they are matched (the projector lies inside Qwen's vision
# tower).
_PART_PATTERNS = {
    "projector": re.compile(r"(^|\.)(multi_modal_projector|connector|mm_projector|visual\.merger|"
                            r"visual\.deepstack_merger_list)(\.|$)"),
    "vision": re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder)(\.|$)"),
}


def auto_class(model_config: Any):
    """The transformers auto class that builds ``model_config``'s model with its output head: image-text-to-text for
    a vision-language model, causal LM otherwise."""
    import transformers

    return (transformers.AutoModelForImageTextToText if is_vision_language(model_config)
            else transformers.AutoModelForCausalLM)


def part_of(name: str) -> str:
    """The part (``vision``, ``projector`` or ``language``) a parameter or module of a vision-language model belongs
    to, by its name."""
    return next((part for part, pattern in _PART_PATTERNS.items() if pattern.search(name)), "language")


def freeze(model, parts) -> None:
    """Freeze the parameters of ``parts`` (no gradient, so no optimizer state)."""
    for name, param in model.named_parameters():
        if part_of(name) in parts:
            param.requires_grad_(False)


def part_roots(model) -> dict[str, list[str]]:
    """The outermost modules of each part but the language model (the vision tower, the projector(s)), by name."""
    roots: dict[str, list[str]] = {"vision": [], "projector": []}
    for name, _ in model.named_modules():
        part = part_of(name)
        if part != "language" and not any(name.startswith(f"{root}.") for root in roots[part]):
            roots[part].append(name)
    return roots


def wrap_classes(model) -> list[str]:
    """The module classes FSDP wraps as units in a vision-language model (built on the meta device): the classes of
    the blocks each part repeats (the members of its module lists whose entries are all of one class: decoder
    layers, vision blocks, Qwen3-VL's deepstack mergers), the projector's class and the vision tower's."""
    import torch

    blocks = [type(module[0]).__name__ for module in model.modules()
              if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1
              and not type(module[0]).__module__.startswith("torch.") and any(p.numel() for p in module.parameters())]
    modules = dict(model.named_modules())
    roots = [type(modules[root]).__name__ for part, names in part_roots(model).items() for root in names
             if not isinstance(modules[root], torch.nn.ModuleList)]
    return list(dict.fromkeys(blocks + roots))


def excluded_modules(model, parts) -> str | None:
    """A regular expression (peft's ``exclude_modules``, matched against whole module names) of the modules of the
    frozen ``parts`` other than the language model, so that LoRA puts no adapter on them; None when none is."""
    roots = [root for part, names in part_roots(model).items() if part in parts for root in names]
    return f"({'|'.join(re.escape(root) for root in roots)})(\\..*)?" if roots else None


class TowerTouch:
    """Runs a vision-language model's vision tower (and projector) on a placeholder image in a forward whose inputs
    have no images, adding 0 times the features to the input embeddings: the loss is what it was, and the tower's
    FSDP units are gathered in the forward and reduced in the backward (zero gradients) as on a rank whose
    micro-batch has images, so that the ranks' collectives match (``forward_keys``: the arguments the model's
    forward takes, :func:`hfsdp.model.loading.forward_arguments`). The placeholder's pixel inputs come with the
    forward's inputs (:data:`~hfsdp.data.images.TOWER_PLACEHOLDER`, taken out before the model sees them): the
    tower runs when the input embeddings are computed, where a forward with images runs it; or before a ``generate``
    call (:meth:`before_generate`)."""

    def __init__(self, model, forward_keys):
        self.model = model  # (a peft model's attributes are its base model's)
        self.takes = set(inspect.signature(model.get_image_features).parameters)
        # generate encodes the images before the prefill where the forward takes them encoded (mm_encoder_outputs)
        self.pre_encodes = "mm_encoder_outputs" in forward_keys
        self.armed: dict | None = None
        model._hfsdp_tower_touch = self  # (touch_of)
        model.register_forward_pre_hook(self._take, with_kwargs=True)
        model.get_input_embeddings().register_forward_hook(self._embedded)

    def before_generate(self, pixels: dict) -> None:
        """Run the tower on ``pixels`` (the placeholder's pixel inputs, on the model's device) where a ``generate``
        call about to start runs it on images: now, where the model's forward takes features encoded beforehand
        (transformers' ``mm_encoder_outputs``: ``generate`` encodes the images before the prefill), else in the
        prefill."""
        if self.pre_encodes:
            self._features(pixels)
        else:
            self.armed = pixels

    def _take(self, module, args, kwargs):
        pixels = kwargs.pop(TOWER_PLACEHOLDER, None)
        if pixels is not None:
            self.armed = pixels
        return args, kwargs

    def _embedded(self, module, args, embeddings):
        if self.armed is None:
            return None
        pixels, self.armed = self.armed, None
        features = self._features(pixels)
        # what transformers' forwards read of the features: the projected ones (pooler_output) and Qwen3-VL's
        # deepstack features, not the tower's other outputs (LLaVA's last layer, which its features skip)
        used = [features.pooler_output, getattr(features, "deepstack_features", None)]
        touched = sum(t.sum() for t in _tensors(used) if t.is_floating_point())
        return embeddings + (touched * 0).to(embeddings.dtype)

    def _features(self, pixels: dict):
        return self.model.get_image_features(**{k: v for k, v in pixels.items() if k in self.takes})


def touch_of(model) -> TowerTouch | None:
    """The :class:`TowerTouch` of ``model``, where the run made one."""
    return getattr(model, "_hfsdp_tower_touch", None)


def _tensors(value) -> list:
    """The tensors in nested tuples and lists."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (list, tuple)) else []


def images_only_processors():
    """Let processors with a video processor (Qwen2.5-VL, Qwen3-VL, Qwen3.5, SmolVLM) be built and loaded without
    torchvision, for images: transformers' video processors need torchvision, and without it such a processor can
    neither be built nor loaded, even to read images. A stand-in takes the video processor's place; nothing changes
    where torchvision is installed. Idempotent. Returns the stand-in's class (None with torchvision), to build such a
    processor with."""
    import transformers
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import PushToHubMixin, is_torchvision_available

    if is_torchvision_available():
        return None
    if hasattr(transformers, "_hfsdp_no_video_processor"):
        return transformers._hfsdp_no_video_processor

    class NoVideoProcessor(PushToHubMixin):  # (serialised as {} in processor_config.json)
        """Stands in for the video processor of a processor that has one (Qwen2.5-VL, Qwen3-VL, Qwen3.5, SmolVLM):
        images work, a video raises."""

        _auto_class = None
        model_input_names: list = []
        valid_kwargs = None
        num_frames = fps = None  # (read by SmolVLMProcessor.apply_chat_template)

        def to_dict(self) -> dict:
            return {}

        def __call__(self, *args, **kwargs):
            raise RuntimeError("video inputs need torchvision (transformers' video processors need it): pip install "
                               "torchvision")

    check = ProcessorMixin.check_argument_for_proper_class
    resolve = ProcessorMixin._resolve_subprocessors.__func__

    def check_argument_for_proper_class(self, argument_name, argument):
        # (the check looks up transformers.VideoProcessorMixin, which transformers exports with torchvision only)
        return NoVideoProcessor if isinstance(argument, NoVideoProcessor) else check(self, argument_name, argument)

    def _resolve_subprocessors(cls, pretrained_model_name_or_path, processor_dict, **kwargs):
        if "video_processor" in cls.get_attributes() and kwargs.get("video_processor") is None:
            kwargs["video_processor"] = NoVideoProcessor()  # given, so AutoVideoProcessor is never asked
        return resolve(cls, pretrained_model_name_or_path, processor_dict, **kwargs)

    ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class
    ProcessorMixin._resolve_subprocessors = classmethod(_resolve_subprocessors)
    transformers._hfsdp_no_video_processor = NoVideoProcessor
    return NoVideoProcessor


def save_processor(processor, folder, chat_template: str | None = None) -> None:
    """``processor.save_pretrained(folder)``, without a stand-in video processor in its processor_config.json (so
    that transformers with torchvision loads the family's own); with ``chat_template`` (the one the run trained with,
    ``data.chat_template``) as its chat template where given."""
    import json
    from pathlib import Path

    own = processor.chat_template
    processor.chat_template = chat_template or own
    try:
        processor.save_pretrained(folder)
    finally:
        processor.chat_template = own
    path = Path(folder) / "processor_config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("video_processor") == {}:
            del data["video_processor"]
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_processor(path: str, tokenizer, revision: str | None = None, trust_remote_code: bool = False):
    """The model's processor (``AutoProcessor``: its image processor and chat template) around ``tokenizer``, which
    then carries it (:func:`processor_of`); the processor's chat template (the one that renders images) becomes the
    tokenizer's."""
    from transformers import AutoProcessor

    from hfsdp.errors import UserError

    images_only_processors()
    try:
        processor = AutoProcessor.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as err:  # a folder without the processor's files, a broken preprocessor_config.json
        raise UserError(f"model.name_or_path: '{path}' is a vision-language model, and its processor does not load "
                        f"({type(err).__name__}: {err}): give a folder with its preprocessor_config.json (and "
                        "processor_config.json), as the model's hub repository has them") from None
    if not hasattr(processor, "image_processor"):
        raise UserError(f"model.name_or_path: '{path}' is a vision-language model whose processor "
                        f"({type(processor).__name__}) has no image processor")
    processor.tokenizer = tokenizer
    if getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    setattr(tokenizer, PROCESSOR_ATTR, processor)
    return processor


def uses_mrope(model_config) -> bool:
    """Whether the model lays out its positions in 3-D (Qwen's multimodal rope: its image tokens' positions are their
    place in the image's grid), from the image's per-token inputs rather than from given ``position_ids``."""
    text = getattr(model_config, "text_config", model_config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return "mrope_section" in rope
