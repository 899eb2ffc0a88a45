"""DCP metadata as other Python releases pickle it: Debian 12's Python 3.11.2 writes enum members as
``getattr(EnumClass, "NAME")``; the restricted unpickler admits exactly that and nothing else through getattr."""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import PurePosixPath

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
)

from hfsdp.checkpoint.safe_load import DcpMetadataUnpickler


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members the way Python 3.11.2 does: a call of builtins.getattr on the class."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _EnumsByGetattr(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def test_enum_members_pickled_through_getattr_are_read():
    props = TensorProperties(dtype=torch.float32)
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        properties=props, size=torch.Size([2, 3]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))])})
    data = _dumps(metadata)
    assert b"getattr" in data  # the stream really uses builtins.getattr
    loaded = DcpMetadataUnpickler(io.BytesIO(data)).load()
    assert loaded.state_dict_metadata["w"].properties == props


class _GetattrOnAdmittedClass:
    """getattr on a class the unpickler admits, for a method that could write files."""

    def __reduce__(self):
        return getattr, (PurePosixPath, "joinpath")


def test_getattr_on_anything_else_is_refused():
    with pytest.raises(pickle.UnpicklingError, match="getattr"):
        DcpMetadataUnpickler(io.BytesIO(pickle.dumps([_GetattrOnAdmittedClass()]))).load()
