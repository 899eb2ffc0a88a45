"""QLoRA's decisions from the config alone, before any weight loads (torch-free): the resolved 4-bit settings
(:func:`settings`: the storage dtype FSDP2 gathers in, the compute dtype) and what cannot work (:func:`problems`).
The torch side (the start-up probe, the dequantized export) is :mod:`hfsdp.model.quantized`, whose docstring says
why each rule holds, and once the model is sharded :mod:`hfsdp.parallel.quantized_base`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


# The bitsandbytes hfsdp is tested with: the 4-bit base and train.optimizer adamw_8bit (pyproject's qlora and
# optimizers extras pin it too; tests/test_optimizers.py holds them to it).
BITSANDBYTES = "bitsandbytes==0.50.2"


# bitsandbytes' blocks: one absmax per 64 weights; double quantization quantizes 256 absmax values at a time.
ITEMSIZE = {"uint8": 1, "float32": 4, "bfloat16": 2, "float16": 2}


BLOCK_SIZE = 64


NESTED_BLOCK_SIZE = 256


@dataclass(frozen=True)
class QuantSettings:
    quant_type: str
    double_quant: bool
    compute_dtype: str
    quant_storage: str

    def state_bytes(self, numel: int) -> int:
        """Bytes of one layer's quantization state (what :func:`hfsdp.parallel.quantized_base.quant_state_bytes`
        counts on a live layer): an fp32 absmax per block of 64 weights and the 16-entry fp32 code book; with double
        quantization the absmax as uint8 codes plus an fp32 absmax per 256 blocks, their fp32 offset and 256-entry
        code book."""
        blocks = -(-numel // BLOCK_SIZE)
        if self.double_quant:
            return blocks + 4 * -(-blocks // NESTED_BLOCK_SIZE) + 4 + 4 * 256 + 4 * 16
        return 4 * blocks + 4 * 16

    def bnb_config(self):
        """transformers' ``BitsAndBytesConfig`` for these settings."""
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quant_type, bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            bnb_4bit_quant_storage=getattr(torch, self.quant_storage))


def settings(config: "HfsdpConfig") -> QuantSettings | None:
    """The resolved quantization (None without ``model.quantization``)."""
    q = config.model.quantization
    if q is None:
        return None
    gathered = _gathered_dtype(config)
    compute = q.compute_dtype or gathered
    storage = q.quant_storage or gathered
    return QuantSettings(q.quant_type or "nf4", True if q.double_quant is None else q.double_quant, compute, storage)


def problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """What cannot work, found from the config alone (before any weight loads)."""
    q = settings(config)
    if q is None:
        return []
    out = []
    where = "model.quantization"
    if not _installed("bitsandbytes"):
        out.append((where, f"needs bitsandbytes, which is not installed: pip install '{BITSANDBYTES}' "
                           "(or pip install 'hfsdp[qlora]')"))
    gathered = _gathered_dtype(config)
    if config.fsdp.version == 1:
        out.append(("fsdp.version", "QLoRA runs under FSDP2 only: FSDP1's flat parameters hold each rank's slice of "
                                    "the packed 4-bit data, and bitsandbytes cannot run a layer from a slice (its "
                                    "forward fails on a rank whose slice is empty): use fsdp.version: 2"))
    elif q.quant_storage not in ("uint8", gathered):
        out.append((f"{where}.quant_storage",
                    f"{q.quant_storage}: FSDP2 gathers floating-point parameters in {gathered} (the mixed-precision "
                    f"param dtype, else model.dtype) and would cast the packed 4-bit bytes to it, scrambling them: "
                    f"set quant_storage: {gathered} (the default: sharded) or uint8 (replicated on every rank)"))
    if config.fsdp.cpu_ram_efficient_loading:
        out.append(("fsdp.cpu_ram_efficient_loading",
                    "every rank quantizes the base as it loads it (host memory: the 4-bit model, not the full one); "
                    "rank 0's 4-bit weights cannot be broadcast into empty ones: remove cpu_ram_efficient_loading"))
    return out


def adapter_problems(config: "HfsdpConfig", trains_adapters: bool) -> list[tuple[str, str]]:
    """A 4-bit base trains only through adapters: ``trains_adapters`` says whether an enabled plugin trains them
    (hook ``hfsdp_trains_adapters``)."""
    if config.model.quantization is None or trains_adapters:
        return []
    return [("model.quantization", "a 4-bit base cannot be trained in full (its packed weights have no gradients): "
                                   "enable a plugin that trains adapters on it, such as lora (`plugins: [lora]`: "
                                   "QLoRA), or remove model.quantization")]


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (bitsandbytes imports torch)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses it
        return False


def _gathered_dtype(config: "HfsdpConfig") -> str:
    """The dtype FSDP2 gathers floating-point parameters in: the mixed-precision param dtype, else model.dtype."""
    from hfsdp.rules.wrapping import precision_parts

    parts = precision_parts(config.fsdp)
    return parts.param if parts is not None else config.model.dtype
