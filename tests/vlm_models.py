"""Tiny random vision-language models of real architectures, offline, on the real SmolLM2 tokenizer (issue 72).

:func:`tiny_vlm_folder` builds, once into the test cache, a model of 2 text layers of width 64 and a 2-layer
vision tower of width 32 (about 6M parameters) with its processor: the SmolLM2 tokenizer plus the family's special
tokens, an image processor sized for small images (4 to 16 image tokens an image), and the family's chat template
as hfsdp ships it (``hfsdp/model/chat_templates``, TRL's copies).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hfsdp.model import chat_template, vision

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "smolvlm", "idefics3", "gemma3", "llava")


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                  + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)])
SPECIAL = {
    "qwen2_5_vl": QWEN_TOKENS,
    "qwen3_vl": QWEN_TOKENS,
    "qwen3_5": QWEN_TOKENS,
    "smolvlm": IDEFICS_TOKENS,
    "idefics3": ["<|begin_of_text|>"] + IDEFICS_TOKENS,
    "gemma3": ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
               "<image_soft_token>"],
    "llava": ["<image>", "</s>"],
}
# Named special tokens set on the tokenizer (saved as extra_special_tokens, so they reload as attributes).
EXTRA = {
    "qwen2_5_vl": dict(image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                       vision_end_token="<|vision_end|>"),
    "smolvlm": dict(image_token="<image>", fake_image_token="<fake_token_around_image>",
                    global_image_token="<global-img>", end_of_utterance_token="<end_of_utterance>"),
    "gemma3": dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"),
    "llava": dict(image_token="<image>"),
}
EXTRA["qwen3_vl"] = EXTRA["qwen3_5"] = EXTRA["qwen2_5_vl"]
EXTRA["idefics3"] = EXTRA["smolvlm"]
# bos/eos the family's template and generation expect (pad stays SmolLM2's <|im_end|> unless set here).
ROLES = {
    "smolvlm": dict(eos_token="<end_of_utterance>"),
    "idefics3": dict(bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>"),
    "gemma3": dict(bos_token="<bos>", eos_token="<end_of_turn>"),
    "llava": dict(eos_token="</s>"),
}
TEMPLATE = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_5": "qwen3_5_nothink", "smolvlm": "smolvlm",
            "idefics3": "idefics3", "gemma3": "gemma3", "llava": "llava_next"}


def _tokenizer(arch: str, tokenizer_folder: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder), extra_special_tokens=EXTRA.get(arch, {}))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[arch]}, replace_extra_special_tokens=False)
    for key, value in ROLES.get(arch, {}).items():
        setattr(tok, key, value)
    tok.chat_template = None  # the processor carries the chat template
    return tok


def _ids(tok, arch: str) -> dict:
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIAL[arch]}


# ---------------------------------------------------------------------------------------------------------------
# Per-family model config + image processor + processor
# ---------------------------------------------------------------------------------------------------------------

def _qwen(arch: str, tok, ids: dict):
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    text = dict(TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    if arch == "qwen2_5_vl":
        patch = 14
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        text.update(rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]))
    elif arch == "qwen3_vl":
        patch = 16
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        text.update(head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 3, 3],
                                                      mrope_interleaved=True))
    else:  # qwen3_5: one Gated-DeltaNet (linear attention) layer and one full-attention layer
        patch = 16
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
        text.update(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4,
                    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                         mrope_section=[2, 1, 1], mrope_interleaved=True))
    config = AutoConfig.for_model(arch, text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    factor = patch * 2
    # Images resize to multiples of patch*merge between factor^2 and (4*factor)^2 pixels: 1..16 image tokens;
    # a 56x56 image becomes 56x56 (4 tokens) for Qwen2.5-VL, 64x64 (4 tokens) for Qwen3-VL/Qwen3.5.
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": factor * factor, "longest_edge": (4 * factor) ** 2}, patch_size=patch,
        merge_size=2, temporal_patch_size=2)
    return config, image_processor, {}


def _idefics(arch: str, tok, ids: dict):
    from transformers import AutoConfig

    if arch == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as IP
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as IP
    side, patch, scale = 32, 8, 2  # 32x32 images, 4x4 patches, pixel-shuffled by 2: 4 image tokens an image
    text = dict(TEXT, model_type="llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=side,
                  patch_size=patch)
    config = AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=ids["<image>"],
                                  scale_factor=scale, tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    image_processor = IP(do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side})
    seq = (side // patch) ** 2 // scale ** 2
    return config, image_processor, dict(image_seq_len=seq)


def _gemma3(arch: str, tok, ids: dict):
    from transformers import AutoConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    side, patch, mm_tokens = 32, 8, 4  # 4x4 patches avg-pooled to 2x2: 4 image tokens an image
    text = dict(TEXT, vocab_size=len(tok), head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=side, patch_size=patch, vision_use_head=False)
    config = AutoConfig.for_model(arch, text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
                                  boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                                  image_token_index=ids["<image_soft_token>"])
    image_processor = Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=False)
    return config, image_processor, dict(image_seq_length=mm_tokens)


def _llava(arch: str, tok, ids: dict):
    from transformers import AutoConfig
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    side, patch = 32, 8  # CLIP: 16 patches + CLS; the "default" feature strategy drops CLS: 16 image tokens
    text = dict(TEXT, model_type="llama", vocab_size=len(tok), head_dim=16, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=side, patch_size=patch, projection_dim=32)
    config = AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                                  image_seq_length=(side // patch) ** 2, vision_feature_select_strategy="default",
                                  vision_feature_layer=-2, tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return config, image_processor, dict(patch_size=patch, num_additional_image_tokens=1,
                                         vision_feature_select_strategy="default")


BUILD = {"qwen2_5_vl": _qwen, "qwen3_vl": _qwen, "qwen3_5": _qwen, "smolvlm": _idefics, "idefics3": _idefics,
         "gemma3": _gemma3, "llava": _llava}
PROCESSOR = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor", "qwen3_5": "Qwen3VLProcessor",
             "smolvlm": "SmolVLMProcessor", "idefics3": "Idefics3Processor", "gemma3": "Gemma3Processor",
             "llava": "LlavaProcessor"}


def make_tiny_vlm(arch: str, folder: Path, tokenizer_folder: Path, seed: int = 0) -> None:
    """Write a tiny random ``arch`` model and its processor into ``folder`` (created; existing files overwritten)."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, GenerationConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(arch, tokenizer_folder)
    config, image_processor, processor_kwargs = BUILD[arch](arch, tok, _ids(tok, arch))
    processor_cls = getattr(transformers, PROCESSOR[arch])
    kwargs = dict(image_processor=image_processor, tokenizer=tok, chat_template=chat_template.resolve(TEMPLATE[arch]))
    stand_in = vision.images_only_processors()
    if "video_processor" in processor_cls.get_attributes() and stand_in is not None:
        kwargs["video_processor"] = stand_in()
    processor = processor_cls(**kwargs, **processor_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    vision.save_processor(processor, folder)


def tiny_vlm_folder(arch: str, cache_dir: Path) -> Path:
    """The tiny ``arch`` model with its processor, randomly initialised from seed 0, built once into ``cache_dir``
    (the same folder for every test process)."""
    from hfsdp.model.loading import _smollm2_tokenizer

    folder = cache_dir / f"tiny-vlm-{arch}-seed0"
    if not (folder / "model.safetensors").is_file():
        _smollm2_tokenizer(cache_dir)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir))
        make_tiny_vlm(arch, tmp, cache_dir / "smollm2-tokenizer")
        try:
            tmp.rename(folder)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp)
    return folder


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 40)}


def colour_rows(folder: Path, n: int = 24, shape: str = "parts", name: str | None = None, seed: int = 0,
                text_every: int = 0) -> Path:
    """A JSONL file of ``n`` one-image colour questions in ``folder`` (images beside it, paths relative to it), in
    one of the row shapes: ``parts`` (content parts naming their image), ``placeholders`` (LLaMA-Factory's
    ``<image>`` with an ``images`` column), ``column`` (TRL's ``images`` column beside plain texts); with
    ``text_every`` k, every k-th row a text-only question instead (content parts, no image)."""
    import json
    import random

    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        colour = rng.choice(sorted(COLOURS))
        image = f"img/{seed}-{i}.png"
        Image.new("RGB", (40 + 8 * (i % 3), 48), COLOURS[colour]).save(folder / image)
        answer, question = f"It is {colour}.", "What colour is this?"
        if text_every and i % text_every == text_every - 1:
            rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
        elif shape == "parts":
            rows.append({"messages": [
                {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
        elif shape == "placeholders":
            rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                      {"role": "assistant", "content": answer}], "images": [image]})
        else:
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                         "images": [image]})
    path = folder / f"{name or shape}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def colour_pairs(folder: Path, n: int = 24, shape: str = "parts", seed: int = 0, text_every: int = 0) -> Path:
    """A JSONL file of ``n`` preference rows in ``folder``: a colour question about one image (beside the file), the
    right colour chosen and another rejected; the prompt's image as a content part (``parts``) or in TRL's
    ``images`` column beside a plain text (``column``); with ``text_every`` k, every k-th prompt a text-only
    question instead."""
    import json
    import random

    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        colour, wrong = rng.sample(sorted(COLOURS), 2)
        image = f"img/pair-{seed}-{i}.png"
        Image.new("RGB", (40 + 8 * (i % 3), 48), COLOURS[colour]).save(folder / image)
        question = "What colour is this?"
        content = [{"type": "image", "image": image}, {"type": "text", "text": question}] if shape == "parts" \
            else question
        text = text_every and i % text_every == text_every - 1
        rows.append({"prompt": [{"role": "user", "content": "Name a colour." if text else content}],
                     "chosen": [{"role": "assistant", "content": f"It is {colour}."}],
                     "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
                     **({"images": [image]} if shape == "column" and not text else {})})
    path = folder / f"pairs-{shape}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def colour_prompts(folder: Path, n: int = 24, seed: int = 0, text_every: int = 0) -> Path:
    """A JSONL file of ``n`` prompt rows in ``folder``: a colour question about one image (beside the file, a content
    part naming it), its ``answer`` in a column of its own; with ``text_every`` k, every k-th a text-only
    question instead."""
    import json

    rows = [json.loads(line) for line in colour_rows(folder, n, seed=seed, text_every=text_every).read_text().splitlines()]
    prompts = [{"prompt": r["messages"][:1], "answer": r["messages"][1]["content"][0]["text"]} for r in rows]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    return path


def colour_data(cache_dir: Path, data_format: str = "chat") -> tuple[Path, Path]:
    """A train file (64 rows) and an eval file (8 rows) of colour questions with their images, as rows of
    ``data_format``: ``chat`` (:func:`colour_rows`), ``preference`` (:func:`colour_pairs`) or ``prompt``
    (:func:`colour_prompts`), built once into ``cache_dir`` (the same files for every test process)."""
    folder = cache_dir / f"vlm-colour-{data_format}"
    if not (folder / "eval.jsonl").is_file():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir))
        for name, n, seed in (("train", 64, 0), ("eval", 8, 1)):
            if data_format == "chat":
                colour_rows(tmp, n, name=name, seed=seed)
            else:
                made = (colour_pairs if data_format == "preference" else colour_prompts)(tmp, n, seed=seed)
                made.rename(tmp / f"{name}.jsonl")
        try:
            tmp.rename(folder)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp)
    return folder / "train.jsonl", folder / "eval.jsonl"
