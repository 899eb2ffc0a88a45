"""Write and read consolidated weights as a Hugging Face folder of safetensors shards.

Tensors are streamed: at most one shard's worth is held at a time, so exporting a sharded checkpoint never needs
the whole model in memory. Every written file is read back and checked (no empty or mis-shaped tensor is ever left
for a later load to trip over).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hfsdp.errors import UserError

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
# `hfsdp export --max-shard-size` reaches the writer through this (the hfsdp_export hook has no such argument).
_max_shard_bytes: contextvars.ContextVar[int] = contextvars.ContextVar("max_shard_bytes", default=DEFAULT_MAX_SHARD_BYTES)


@contextlib.contextmanager
def max_shard_size(max_bytes: int | None):
    """Within the block, files written by :func:`write_hf_weights` hold at most ``max_bytes`` (None: the default);
    the writer holds at most one file's worth of tensors in memory."""
    token = _max_shard_bytes.set(max_bytes or DEFAULT_MAX_SHARD_BYTES)
    try:
        yield
    finally:
        _max_shard_bytes.reset(token)


def parse_size(text: str) -> int:
    """``"200MB"`` → 200_000_000, ``"1GiB"`` → 1_073_741_824, ``"5000"`` → 5000 bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise UserError(f"size '{text}': give a positive number with a unit, e.g. 200MB, 2GB or 512MiB")
    return int(value * units[unit])
INDEX_NAME = "model.safetensors.index.json"


def expected_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of the architecture, from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _drop_tied(names: set[str], model_config) -> set[str]:
    if getattr(model_config, "tie_word_embeddings", False) and "lm_head.weight" in names:
        return {"lm_head.weight"}
    return set()


def write_hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    expected: Mapping[str, tuple[int, ...]] | None,
    skip: set[str] = frozenset(),
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` (or numbered shards plus an index) into ``out_dir``.

    Raises UserError when a tensor is empty or does not have its expected shape, before anything is renamed
    into place. Returns the names written.
    """
    max_shard_bytes = max_shard_bytes or _max_shard_bytes.get()
    out_dir.mkdir(parents=True, exist_ok=True)
    shard_files: list[tuple[str, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    written: list[str] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"shard-{len(shard_files):05d}.tmp"
        save_file(pending, str(out_dir / name), metadata={"format": "pt"})
        shard_files.append((name, list(pending)))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        if name in skip:
            continue
        _check_tensor(name, tuple(tensor.shape), tensor.numel(), expected)
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor
        pending_bytes += size
        written.append(name)
    flush()
    if expected is not None:
        missing = sorted(set(expected) - set(written) - skip)
        if missing:
            raise UserError(f"export: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    total = len(shard_files)
    weight_map = {}
    for i, (tmp_name, names) in enumerate(shard_files):
        final = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(out_dir / tmp_name, out_dir / final)
        weight_map.update({n: final for n in names})
    if total > 1:
        (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    verify_hf_weights(out_dir, expected, skip)
    return written


def _check_tensor(name: str, shape: tuple[int, ...], numel: int, expected: Mapping[str, tuple[int, ...]] | None) -> None:
    if numel == 0:
        raise UserError(f"export: tensor '{name}' is empty (shape {list(shape)}); refusing to write a broken model")
    if expected is not None:
        if name not in expected:
            raise UserError(f"export: unexpected tensor '{name}' for this architecture")
        if expected[name] != shape:
            raise UserError(f"export: tensor '{name}' has shape {list(shape)}, expected {list(expected[name])}")


def weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_NAME).is_file():
        index = json.loads((folder / INDEX_NAME).read_text())
        return [folder / f for f in sorted(set(index["weight_map"].values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def verify_hf_weights(folder: Path, expected: Mapping[str, tuple[int, ...]] | None, skip: set[str] = frozenset()) -> None:
    """Read back every header: each tensor non-empty and of its expected shape, none missing."""
    seen = set()
    files = weight_files(folder)
    if not files:
        raise UserError(f"{folder}: no safetensors weights found")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                numel = 1
                for d in shape:
                    numel *= d
                _check_tensor(name, shape, numel, expected)
                seen.add(name)
    if expected is not None:
        missing = sorted(set(expected) - seen - skip)
        if missing:
            raise UserError(f"{folder}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")


def write_hf_folder(
    state_dict: Mapping[str, torch.Tensor],
    model_config,
    tokenizer,
    out_dir: Path,
    *,
    generation_config=None,
    max_shard_bytes: int | None = None,
) -> Path:
    """A complete, verified Hugging Face model folder written into ``out_dir`` (the empty folder the
    ``hfsdp_export`` hook receives; hfsdp renames it into place afterwards)."""
    out_dir = Path(out_dir)
    expected = expected_shapes(model_config)
    skip = _drop_tied(set(state_dict.keys()), model_config)
    write_hf_weights(state_dict.items(), out_dir, expected=expected, skip=skip, max_shard_bytes=max_shard_bytes)
    model_config.save_pretrained(out_dir)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def model_metadata(model_dir: str | Path) -> dict[str, Any]:
    """The generation config of a model folder, if it has one."""
    from transformers import GenerationConfig

    try:
        return {"generation_config": GenerationConfig.from_pretrained(str(model_dir))}
    except OSError:
        return {"generation_config": None}
