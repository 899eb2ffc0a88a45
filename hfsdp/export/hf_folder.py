"""Write and read consolidated weights as a Hugging Face folder of safetensors shards.

Tensors are streamed: one tensor at a time is held in memory and written out before the next is read, so exporting
a sharded checkpoint never needs the whole model (nor one output file's worth) in memory. Every written file is read
back and checked (no empty or mis-shaped tensor is ever left for a later load to trip over).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open

from hfsdp.checkpoint.safe_load import INDEX_NAME
from hfsdp.errors import UserError
from hfsdp.model.metadata import ModelFiles
from hfsdp.units import GIB, KIB, MIB, TIB

DEFAULT_MAX_SHARD_BYTES = 2 * GIB
def parse_size(text: str) -> int:
    """``"200MB"`` → 200_000_000, ``"1GiB"`` → 1_073_741_824, ``"5000"`` → 5000 bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": TIB}
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


def write_hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    expected: Mapping[str, tuple[int, ...]] | None,
    skip: set[str] = frozenset(),
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` (or numbered shards plus an index) into ``out_dir``.

    Each file holds at most ``max_shard_bytes`` (None: :data:`DEFAULT_MAX_SHARD_BYTES`); the writer holds one tensor
    at a time in memory, whatever the size. Raises UserError when a tensor is empty or does not have its expected
    shape, before anything is renamed into place. Returns the names written.
    """
    max_shard_bytes = max_shard_bytes or DEFAULT_MAX_SHARD_BYTES
    out_dir.mkdir(parents=True, exist_ok=True)
    shard_files: list[tuple[str, list[str]]] = []
    shard: _SafetensorsStream | None = None
    written: list[str] = []
    try:
        for name, tensor in tensors:
            if name in skip:
                continue
            _check_tensor(name, tuple(tensor.shape), tensor.numel(), expected)
            tensor = tensor.detach().to("cpu").contiguous()
            size = tensor.numel() * tensor.element_size()
            if shard is not None and shard.size + size > max_shard_bytes:
                shard_files.append(shard.close())
                shard = None
            if shard is None:
                shard = _SafetensorsStream(out_dir / f"shard-{len(shard_files):05d}.tmp")
            shard.add(name, tensor)
            del tensor  # hold one tensor at a time
            written.append(name)
        if shard is not None:
            shard_files.append(shard.close())
    finally:
        if shard is not None:
            shard.discard()
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


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class _SafetensorsStream:
    """One safetensors file written a tensor at a time, so that memory never holds more than the tensor being added:
    tensor bytes go to a scratch file as they arrive; :meth:`close` writes the header (it needs every name, shape
    and offset) and appends the bytes with a kernel-side copy."""

    def __init__(self, path: Path):
        self.path = path
        self.scratch_path = path.with_name(path.name + ".data")
        self.scratch = open(self.scratch_path, "w+b")
        self.entries: dict[str, dict[str, Any]] = {}
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"export: tensor '{name}' has dtype {tensor.dtype}, which safetensors cannot store")
        raw = tensor.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
        self.scratch.write(memoryview(raw))
        self.entries[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.size, self.size + raw.nbytes]}
        self.size += raw.nbytes

    def close(self) -> tuple[str, list[str]]:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.scratch.flush()
        with open(self.path, "wb") as out:
            out.write(struct.pack("<Q", len(header)) + header)
            out.flush()
            try:
                copied = 0
                while copied < self.size:  # in the kernel: the bytes never pass through this process's memory
                    n = os.copy_file_range(self.scratch.fileno(), out.fileno(), self.size - copied, copied)
                    if n == 0:
                        raise OSError(f"{self.scratch_path}: short copy ({copied} of {self.size} bytes)")
                    copied += n
            except (AttributeError, OSError) as err:  # no copy_file_range (not Linux, or not this file system)
                if isinstance(err, OSError) and err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                                                   errno.EOPNOTSUPP):
                    raise
                out.seek(8 + len(header))
                out.truncate()
                self.scratch.seek(0)
                shutil.copyfileobj(self.scratch, out, 16 * 2**20)
        self.discard()
        return self.path.name, list(self.entries)

    def discard(self) -> None:
        self.scratch.close()
        self.scratch_path.unlink(missing_ok=True)


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


def write_model_folder(state_dict: Mapping[str, torch.Tensor], files: ModelFiles, out_dir: Path, *,
                       max_shard_bytes: int | None = None) -> Path:
    """A complete, verified Hugging Face model folder written into ``out_dir`` (the empty folder the
    ``hfsdp_export`` hook receives; hfsdp renames it into place afterwards), in the layout transformers'
    ``save_pretrained`` writes (a mixture of experts' weights one tensor per expert, as the hub holds them)."""
    out_dir = Path(out_dir)
    # a tied output head is the input embedding: never written (a safetensors checkpoint may not even hold it)
    skip = {"lm_head.weight"} if files.tied else set()
    tensors, expected = state_dict.items(), files.expected
    if files.layout is not None:  # the layout save_pretrained writes (hfsdp.model.metadata.SavedLayout)
        layout = files.layout
        tensors = ((saved, tensor) for name, weight in tensors if name not in skip
                   for saved, tensor in layout(name, weight).items())
        expected = layout.shapes()
        skip = {saved for name in skip for saved in layout.names(name)}
    write_hf_weights(tensors, out_dir, expected=expected, skip=skip, max_shard_bytes=max_shard_bytes)
    files.save(out_dir)
    return out_dir


def write_hf_folder(
    state_dict: Mapping[str, torch.Tensor],
    model_config,
    tokenizer,
    out_dir: Path,
    *,
    generation_config=None,
    max_shard_bytes: int | None = None,
) -> Path:
    """:func:`write_model_folder` for transformers objects (the helper plugins use, e.g. LoRA's merged export)."""
    return write_model_folder(state_dict, ModelFiles.of(model_config, tokenizer, generation_config), out_dir,
                              max_shard_bytes=max_shard_bytes)
