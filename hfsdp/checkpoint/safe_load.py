"""Reading checkpoint files that may come from elsewhere without running code from them.

A checkpoint holds pickles in three places, and plain unpickling runs whatever a crafted file asks for:

* ``<dcp folder>/.metadata`` of a SHARDED checkpoint, which torch's DCP reads with ``pickle.load``: read here with
  :class:`DcpMetadataUnpickler`, which admits only the classes DCP metadata is made of;
* the non-tensor entries of a DCP folder (e.g. the optimizer's ``param_groups``), which DCP's default load planner
  reads with ``torch.load(weights_only=False)``: each is checked here with ``weights_only=True`` first;
* Accelerate's ``random_states_<rank>.pkl`` and ``custom_checkpoint_<i>.pkl`` (LR scheduler, trainer state, grad
  scaler), ``torch.save`` files that Accelerate reads with ``weights_only=False`` (custom objects) or silently skips
  when they fail to load (RNG states): checked here with ``weights_only=True`` and the numpy types Accelerate admits.

:func:`verify_checkpoint` checks all of them before ``--resume`` lets Accelerate load the folder; ``hfsdp export``
reads DCP metadata only through :func:`read_dcp_metadata`, and a checkpoint's weights one tensor at a time through
:class:`CheckpointWeights`. Tensor files (``*.distcp`` tensors, ``*.bin``,
``*.safetensors``) are read by torch/Accelerate with ``weights_only=True`` or by safetensors, which run no code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsdp.errors import UserError

if TYPE_CHECKING:
    import torch

DCP_METADATA = ".metadata"
_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name (torch.strided)
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}


class UnsafeCheckpointError(UserError):
    """A checkpoint file that hfsdp refuses to load because loading it could run code."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: refusing to load it: {why}; this file was not written by hfsdp/torch DCP as it "
                         "is, or has been tampered with")


def _enum_member(cls: Any, name: str) -> Any:
    """What ``builtins.getattr`` may do in DCP metadata: pick a member of an admitted enum by name (some Python
    releases, Debian 12's 3.11.2 among them, pickle enum members as ``getattr(cls, name)``)."""
    import enum

    admitted = {getattr(__import__(module, fromlist=["_"]), attr, None)
                for module, names in _DCP_MODULES.items() for attr in names}
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in admitted and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"it calls getattr({getattr(cls, '__qualname__', cls)!r}, {name!r}), which is not "
                                 "a member of a DCP metadata enum (unpickling it could run code)")


class DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: every global the stream names must be one of the DCP metadata
    classes, ``torch.Size``, a ``torch.dtype``, a layout, or a posix path; ``getattr`` only picks enum members."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "builtins" and name == "getattr":
            return _enum_member
        if name in _DCP_MODULES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP checkpoint metadata never contains "
                                     "(unpickling it could run code)")


def read_dcp_metadata(folder: Path):
    """The ``Metadata`` of a DCP folder, read with :class:`DcpMetadataUnpickler` and checked for shape: a
    ``Metadata`` whose every entry is tensor or bytes metadata stored in a plain file of this folder."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata,
    )

    path = folder / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{folder}: no {DCP_METADATA} file: not a complete DCP checkpoint folder") from None
    except Exception as err:  # UnpicklingError from find_class, or any error of a malformed stream
        raise UnsafeCheckpointError(path, str(err) or type(err).__name__) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointError(path, f"it holds a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise UnsafeCheckpointError(path, f"entry {key!r} is a {type(entry).__name__}, not tensor or bytes metadata")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not isinstance(info.relative_path, str) or Path(info.relative_path).name != info.relative_path \
                or info.relative_path in ("", ".", ".."):
            raise UnsafeCheckpointError(path, f"storage entry {index!r} points outside its folder or is malformed")
    return metadata


def load_weights_only(path: Path, what: str = "a plain torch.save file", **load: Any) -> Any:
    """``torch.load(path, weights_only=True)`` with numpy's array types admitted (as Accelerate does for RNG
    states); a file that needs anything else is refused with one line naming it."""
    import torch
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    try:
        with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, **load)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(path, f"not {what} (loaded with weights_only=True, which never runs code from a "
                                          f"file: {first})") from None


def _check_dcp_bytes(folder: Path) -> None:
    """Every non-tensor entry of a DCP folder must load with ``weights_only=True`` (DCP itself would unpickle it
    without restriction)."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder)
    byte_keys = {key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_keys:
            continue
        path = folder / info.relative_path
        if info.transform_descriptors:
            raise UnsafeCheckpointError(path, f"entry {index.fqn!r} is stored transformed "
                                              f"({', '.join(map(str, info.transform_descriptors))}), which hfsdp "
                                              "cannot check before DCP unpickles it")
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except OSError as err:
            raise UserError(f"{path}: cannot read entry {index.fqn!r}: {err}") from None
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UnsafeCheckpointError(path, f"entry {index.fqn!r} is not plain data (loaded with weights_only=True, "
                                              f"which never runs code from a file: {first})") from None


def verify_checkpoint(checkpoint: Path) -> None:
    """Check every file of a checkpoint that Accelerate or DCP would unpickle on ``load_state``, before it does.
    Raises :class:`UnsafeCheckpointError` (exit 2) naming the first file that could run code; nothing is run."""
    for metadata in sorted(checkpoint.glob(f"*/{DCP_METADATA}")):
        _check_dcp_bytes(metadata.parent)
    for state in sorted(checkpoint.glob("*.pkl")):
        load_weights_only(state, "a plain state file")


INDEX_NAME = "model.safetensors.index.json"  # beside the numbered files of weights written in shards


class CheckpointWeights(Mapping):
    """The model weights of a checkpoint, name -> tensor, read lazily one tensor at a time, whatever layout saved
    them: a DCP folder (SHARDED_STATE_DICT), a ``torch.save`` file (FULL_STATE_DICT) or safetensors (DDP; and a run's
    ``final/``, in shards with their index when it was written so)."""

    def __init__(self, checkpoint: Path):
        import torch

        self.checkpoint = checkpoint
        dcp_dir = checkpoint / "pytorch_model_fsdp_0"
        full_bin = checkpoint / "pytorch_model_fsdp.bin"
        safetensors_file = checkpoint / "model.safetensors"
        self._full: dict[str, torch.Tensor] | None = None
        if dcp_dir.is_dir():
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            self._dcp_dir = dcp_dir
            metadata = read_dcp_metadata(dcp_dir)  # once, through the restricted unpickler
            self._storage = metadata.storage_data
            meta = metadata.state_dict_metadata
            self._meta = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
            odd = [k for k, v in self._meta.items() if not isinstance(v, TensorStorageMetadata)]
            if odd:
                raise UnsafeCheckpointError(dcp_dir / DCP_METADATA, f"model entries that are not tensors: {odd[:3]}")
            self.layout = "sharded (DCP)"
        elif full_bin.is_file():
            # weights_only: a checkpoint is data; unpickling arbitrary objects would run arbitrary code.
            self._full = load_weights_only(full_bin, "a plain tensor file saved by torch.save", mmap=True)
            bad = [k for k, v in self._full.items() if not isinstance(v, torch.Tensor)] \
                if isinstance(self._full, dict) else ["<top level>"]
            if bad:
                raise UserError(f"{full_bin}: expected a mapping of names to tensors; not tensors: {bad[:3]}")
            self.layout = "full (torch.save)"
        elif safetensors_file.is_file() or (checkpoint / INDEX_NAME).is_file():
            import json

            from safetensors import safe_open

            files = [safetensors_file] if safetensors_file.is_file() else sorted(
                {checkpoint / f for f in json.loads((checkpoint / INDEX_NAME).read_text())["weight_map"].values()})
            handles = [safe_open(str(f), framework="pt") for f in files]  # memory-mapped, one tensor a read
            self._safetensors = {name: handle for handle in handles for name in handle.keys()}
            self._names_in_file = list(self._safetensors)
            self.layout = "full (safetensors)"
        else:
            raise UserError(f"{checkpoint}: no model weights found (expected pytorch_model_fsdp_0/, "
                            "pytorch_model_fsdp.bin or model.safetensors)")

    def _names(self) -> list[str]:
        if self._full is not None:
            return list(self._full)
        return list(self._meta) if self.layout == "sharded (DCP)" else self._names_in_file

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._full is not None:
            return self._full[name]
        if self.layout == "full (safetensors)":
            return self._safetensors[name].get_tensor(name)
        return self._read_dcp_tensor(name)

    def _read_dcp_tensor(self, name: str) -> torch.Tensor:
        """Assemble one tensor from its saved chunks (each a ``torch.save`` record inside a ``.distcp`` file, read
        with ``weights_only=True``), without DCP's planner: no process group, no re-reading of the metadata."""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.utils import _create_file_view

        meta = self._meta[name]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            info = self._storage.get(MetadataIndex(f"model.{name}", chunk.offsets))
            if info is None or info.transform_descriptors:
                raise UnsafeCheckpointError(self._dcp_dir / DCP_METADATA, f"tensor {name!r} has a chunk that is "
                                            "missing or stored transformed (not written by hfsdp)")
            path = self._dcp_dir / info.relative_path
            with open(path, "rb") as f:
                piece = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                   weights_only=True)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(chunk.sizes):
                raise UserError(f"{path}: a chunk of tensor {name!r} is not the {list(chunk.sizes)} tensor the "
                                "checkpoint metadata says; the checkpoint is damaged")
            covered += piece.numel()
            region = tensor
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, length)
            region.copy_(piece)
        if covered != tensor.numel():
            raise UserError(f"{self._dcp_dir}: the saved chunks of tensor {name!r} cover {covered} of its "
                            f"{tensor.numel()} elements; the checkpoint is damaged")
        return tensor
