"""Images in rows, for vision-language models (:mod:`hfsdp.model.vision`).

Rows come in the shapes people have:

* OpenAI / TRL content parts: a message's ``content`` is a list of ``{"type": "text", "text": ...}`` and
  ``{"type": "image", "image": ...}`` (or ``{"type": "image_url", "image_url": {"url": ...}}``) parts; an image part
  without its image takes the next one of the row's ``images`` column;
* TRL's ``images`` column beside messages whose contents are texts without placeholders: the images go at the start
  of the first user message (TRL's ``prepare_multimodal_messages``);
* LLaMA-Factory's ``<image>`` placeholders in a message's text, one per entry of the ``images`` column, in order.

An image is a path (relative to the data file's folder, or absolute), a ``data:image/...;base64,`` URI, bytes, a
``{"bytes": ..., "path": ...}`` mapping (a datasets ``Image`` column read without decoding) or a PIL image (one read
with decoding). Each is kept as its encoded bytes (a PIL image as PNG): tokenization expands each image's
placeholder into the image tokens the processor gives it (:func:`expand`, cached with the other columns), and each
micro-batch's pixel inputs are made from the same bytes by the model's image processor (:class:`PixelInputs`), as
TRL's collator does. A row whose image cannot be found or read, or whose placeholders and images do not match, is a
:class:`~hfsdp.errors.RowError` naming it.
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any

from hfsdp import IGNORE_INDEX
from hfsdp.errors import RowError

IMAGES_COLUMN = "images"  # the rows' images (raw: as given; tokenized: their encoded bytes)
PLACEHOLDER = "<image>"  # LLaMA-Factory's placeholder of an image in a message's text
IMAGE_PARTS = ("image", "image_url")
# The data formats whose rows may show images, in the messages that refuse them elsewhere.
FORMATS_WITH_IMAGES = ("only data.format chat (supervised fine-tuning), preference (dpo, simpo) and prompt (grpo, "
                       "rloo) train on images")


# Where a vision-language model's tokenizer carries its processor (hfsdp.model.vision.load_processor): the data
# formats get the tokenizer, and read images with the processor it carries.
PROCESSOR_ATTR = "hfsdp_processor"
# The model input that carries a micro-batch without images the pixel inputs of a placeholder image
# (:class:`PixelInputs`), and its side in pixels (28: one merged patch of Qwen's towers; each family resizes it to
# the least it takes).
TOWER_PLACEHOLDER = "hfsdp_tower_placeholder"
PLACEHOLDER_SIDE = 28


def processor_of(tokenizer):
    """The processor a vision-language model's tokenizer carries, else None."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def data_folder(path: str | None) -> Path | None:
    """The folder relative image paths of a local data file (or folder of files) are read from, else None."""
    if not path:
        return None
    local = Path(path).expanduser()
    return local if local.is_dir() else local.parent if local.exists() else None


def image_bytes(value: Any, base: Path | None, what: str) -> bytes:
    """The encoded bytes of one image as a row gives it (see the module docstring), or a RowError naming ``what``."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("url") or value.get("path"):
            return image_bytes(value.get("url") or value.get("path"), base, what)
        raise RowError(f"{what} is a mapping without bytes or a path (keys {sorted(value)})")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        out = io.BytesIO()
        value.save(out, format="PNG")
        return out.getvalue()
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"{what} is {type(value).__name__ if value is not None else 'missing'}: give a file path, a "
                       "data: URI, or the image's bytes")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if ";base64" not in head or not payload:
            raise RowError(f"{what} is a data URI without base64 content ({head[:40]}...)")
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError as err:
            raise RowError(f"{what} is a data URI whose base64 content is damaged ({err})") from None
    if value.startswith(("http://", "https://")):
        raise RowError(f"{what} is a URL ({value[:80]}): hfsdp reads no image over the network; download the images "
                       "and give their paths (relative to the data file)")
    path = Path(value.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.is_file():
        raise RowError(f"{what}: no file {path}" + (" (relative paths are read from the data file's folder)"
                                                   if not Path(value).is_absolute() else ""))
    return path.read_bytes()


def decode(data: bytes, what: str = "an image"):
    """An image's bytes as an RGB PIL image, or a RowError when they are not an image PIL reads."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise RowError(f"{what} cannot be read as an image ({type(err).__name__}: {err})") from None
    return image.convert("RGB")


def _part_image(part: dict, what: str) -> Any:
    """The image a content part carries itself, or None when it takes the next one of the images column."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not url:
            raise RowError(f"{what} has no image_url.url")
        return url
    return next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)


def _given(column: Any) -> list:
    """A row's images column as a list of its entries (none for a missing value)."""
    return list(column) if isinstance(column, (list, tuple)) else [] if column is None else [column]


def no_images_beside_text(column: Any) -> None:
    """A RowError where a row whose prompt is a text has images (the preference and prompt formats): only messages
    show them."""
    if column != "" and _given(column):
        raise RowError(f"has images and a text prompt: give the prompt as a list of messages (the images in a user "
                       f"message, or in the {IMAGES_COLUMN} column beside it), which the model's processor renders "
                       "with its image tokens")


def fitted(data: bytes, max_pixels: int | None, what: str) -> bytes:
    """An image's bytes, scaled down to at most ``max_pixels`` pixels (``data.image_max_pixels``), its aspect ratio
    kept, as a PNG; unchanged when it has no more (or no limit is set)."""
    if max_pixels is None:
        return data
    image = decode(data, what)
    area = image.width * image.height
    if area <= max_pixels:
        return data
    from PIL import Image

    factor = math.sqrt(max_pixels / area)
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    out = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(out, format="PNG")
    return out.getvalue()


def with_images(messages: list[dict], column: Any, base: Path | None,
                max_pixels: int | None = None) -> tuple[list[dict], list[bytes]]:
    """The messages of one row (from :func:`hfsdp.builtin.chat.conversation`) with each image as a bare
    ``{"type": "image"}`` part (as the processors' chat templates render them), and the row's images in their
    order, each scaled down to at most ``max_pixels`` pixels (:func:`fitted`): see the module docstring for the
    shapes read. A RowError when they do not match."""
    given = _given(column)
    images: list[bytes] = []
    taken = 0
    placeholders = False
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        parts = None
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if part["type"] == "text":
                    parts.append(part)
                    continue
                what = f"message {i}'s content part {k}"
                own = _part_image(part, what)
                placeholders = placeholders or own is None
                if own is None:
                    if taken == len(given):
                        raise RowError(f"{what} is an image without its image, and the {IMAGES_COLUMN} column has "
                                       f"only {len(given)}: give each image part its image, or one "
                                       f"{IMAGES_COLUMN} entry per image part")
                    own, taken = given[taken], taken + 1
                images.append(image_bytes(own, base, f"{what}'s image"))
                parts.append({"type": "image"})
        elif isinstance(content, str) and PLACEHOLDER in content:
            placeholders = True
            parts = []
            pieces = content.split(PLACEHOLDER)
            for k, piece in enumerate(pieces):
                if piece:
                    parts.append({"type": "text", "text": piece})
                if k < len(pieces) - 1:
                    if taken == len(given):
                        raise RowError(f"message {i} has more {PLACEHOLDER} placeholders than the row has images "
                                       f"({len(given)} in its {IMAGES_COLUMN} column): give one image per "
                                       "placeholder")
                    images.append(image_bytes(given[taken], base, f"{IMAGES_COLUMN} entry {taken}"))
                    taken += 1
                    parts.append({"type": "image"})
        if parts is not None and any(p["type"] == "image" for p in parts) and message["role"] != "user" \
                and message["role"] != "system":
            raise RowError(f"message {i} ({message['role']}) holds an image: images go in user messages (an "
                           "assistant's images would be trained as its text)")
        out.append({**message, "content": parts} if parts is not None else message)
    if taken < len(given):
        if placeholders or images:
            raise RowError(f"the row has {len(given)} images in its {IMAGES_COLUMN} column and {taken} placeholders "
                           f"for them: give one {PLACEHOLDER} (or image part) per image")
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first is None:
            raise RowError("the row has images but no user message to show them in")
        images = [image_bytes(v, base, f"{IMAGES_COLUMN} entry {k}") for k, v in enumerate(given)]
        text = out[first]["content"]
        out[first] = {**out[first], "content": [{"type": "image"} for _ in given]
                      + ([{"type": "text", "text": text}] if isinstance(text, str) else list(text))}
    return out, [fitted(data, max_pixels, f"image {k}") for k, data in enumerate(images)]


def as_parts(messages: list[dict]) -> list[dict]:
    """Messages whose texts are given as one text part each (as TRL gives a vision-language model's template every
    message: LLaVA's reads parts only); a tool result stays a text."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) and m["role"] != "tool" else m for m in messages]


def text_only(messages: list[dict]) -> list[dict]:
    """Messages with each content's text parts joined into one text and its image parts left out (a text-only
    model's template reads texts)."""
    return [{**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
            if isinstance(m.get("content"), list) else m for m in messages]


def count(messages: list[dict]) -> int:
    """How many image parts the messages hold."""
    return sum(p["type"] == "image" for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def expand(processor, text: str, images: list[bytes], ids: list[int], labels: list[int]) -> dict[str, list]:
    """One rendered row's tokens with each image placeholder expanded as the processor expands it (the image's
    tokens: Qwen's one pad token per merged patch, Idefics3's tiles and their markers, Gemma 3's soft tokens between
    blank lines), none of them labelled: ``ids`` and ``labels`` are the row's tokens with the text tokenized as it
    is. The labelled tokens are placed in the expanded ones by aligning both (every labelled token must be found
    there). Returns ``input_ids``, ``labels``, the processor's other per-token inputs (Gemma 3's ``token_type_ids``,
    Qwen's ``mm_token_type_ids``) and the images' bytes."""
    import difflib

    expanded, extras = processed(processor, text, images)
    new_labels = [IGNORE_INDEX] * len(expanded)
    placed = 0
    matcher = difflib.SequenceMatcher(a=ids, b=expanded, autojunk=False)
    for block in matcher.get_matching_blocks():
        new_labels[block.b:block.b + block.size] = labels[block.a:block.a + block.size]
        placed += sum(label != IGNORE_INDEX for label in labels[block.a:block.a + block.size])
    if placed != sum(label != IGNORE_INDEX for label in labels):
        raise RowError(f"{type(processor).__name__} tokenizes this row's trained text differently once its images "
                       "are expanded: its labels cannot be placed")
    return {"input_ids": expanded, "labels": new_labels, IMAGES_COLUMN: images, **extras}


def processed(processor, text: str, images: list[bytes]) -> tuple[list[int], dict[str, list]]:
    """A rendered text's tokens with each image placeholder expanded by the processor for ``images`` (their bytes),
    and the processor's other per-token inputs (Gemma 3's ``token_type_ids``, Qwen's ``mm_token_type_ids``)."""
    pil = [decode(data, f"image {k}") for k, data in enumerate(images)]
    out = processor(text=[text], images=pil or None, add_special_tokens=False)
    expanded = list(out["input_ids"][0])
    extras = {key: list(value[0]) for key, value in out.items()
              if key not in ("input_ids", "attention_mask") and isinstance(value, list) and len(value) == 1
              and isinstance(value[0], list) and len(value[0]) == len(expanded)}
    return expanded, extras


def rows_with_images(split) -> int:
    """How many rows of a tokenized split have an image."""
    import pyarrow.compute as pc

    if not len(split) or IMAGES_COLUMN not in split.column_names:
        return 0
    counts = pc.fill_null(pc.list_value_length(split.with_format("arrow")[IMAGES_COLUMN]), 0)
    return int(pc.sum(pc.greater(counts, 0)).as_py() or 0)


def has_images(splits: list[Any]) -> bool:
    """Whether any row of the tokenized ``splits`` (None where absent) has an image."""
    return any(split is not None and rows_with_images(split) for split in splits)


class PixelInputs:
    """A micro-batch's pixel inputs: its rows' images (their bytes) through the model's image processor, nested per
    row as transformers' processors batch them (Qwen's patches of every image in one tensor with each image's grid,
    Idefics3's images per row padded to the row with most), the keys the model's forward takes.

    With ``touch_tower`` (the run's rows have images), a micro-batch without images gets instead, under
    :data:`TOWER_PLACEHOLDER`, the pixel inputs of a small black placeholder image, on which
    :class:`hfsdp.model.vision.TowerTouch` runs the vision tower and adds 0 times its features to the embeddings:
    every forward then runs the tower and every backward reaches its parameters, as FSDP needs every rank's
    forward and backward to gather and reduce the same units (a micro-batch of text-only rows, or a rank's padding
    row, beside another rank's images)."""

    def __init__(self, processor, forward_keys, touch_tower: bool = False):
        self.image_processor = processor.image_processor
        self.forward_keys = set(forward_keys)
        self.touch_tower = touch_tower
        self._placeholder: dict[str, Any] | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        nested = [[decode(data) for data in row.get(IMAGES_COLUMN) or ()] for row in rows]
        if not any(nested):
            return {TOWER_PLACEHOLDER: self.placeholder()} if self.touch_tower else {}
        return self._processed([images for images in nested if images])

    def placeholder(self) -> dict[str, Any]:
        """The pixel inputs of the placeholder image (one image, not split into tiles), made once."""
        if self._placeholder is None:
            from PIL import Image

            side = PLACEHOLDER_SIDE
            options = {"do_image_splitting": False} if hasattr(self.image_processor, "do_image_splitting") else {}
            self._placeholder = self._processed([[Image.new("RGB", (side, side))]], **options)
        return self._placeholder

    def _processed(self, nested: list[list], **options) -> dict[str, Any]:
        out = self.image_processor(images=nested, return_tensors="pt", **options)
        return {k: v for k, v in out.items() if k in self.forward_keys}
