"""Byte units and dtype sizes, defined once (pure Python: the commands that never import torch use them too)."""

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40
# The dtype names a config can give (``hfsdp.config.schema.DType``) and their bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The 16-bit mixed-precision shorthands (``fsdp.mixed_precision``) and the dtype each computes in.
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
