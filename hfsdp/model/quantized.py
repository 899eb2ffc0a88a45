"""QLoRA: a 4-bit base model (bitsandbytes, loaded through transformers' ``BitsAndBytesConfig``), LoRA on top.

Decisions, made once from the config before any weight loads (:func:`settings`, :func:`problems`):

* FSDP2 shards the packed 4-bit data when it is stored in a floating-point dtype: by default the dtype the
  frozen weights are gathered in (the mixed-precision param dtype, else ``model.dtype``), so that mixed precision
  never casts the packed bytes (a cast would scramble them: a config error). Packed data stored in ``uint8`` is
  kept out of FSDP2 by Accelerate (``ignored_params``): replicated on every rank, exact, at 0.5 byte per weight
  per rank; the start-up report and ``hfsdp plan`` state it.
* bf16 storage can form NaN bit patterns, which a GPU all-gather may canonicalise (bitsandbytes #1945); that is
  what the start-up probe is for.
* FSDP1 is refused: its flat parameters view each rank's shard of the packed data, and bitsandbytes' forward on a
  rank whose shard is empty fails (``shape '[64, 32]' is invalid for input of size 0`` on 2 CPU ranks).
* The quantization state (scales, code book) lives on each ``Linear4bit`` module, not on the parameter FSDP
  replaces; bitsandbytes re-attaches it to the gathered weight in every forward.

The start-up probe is taken here before sharding (:func:`probe_before_sharding`) and checked once the model is
sharded (:func:`hfsdp.parallel.quantized_base.check_sharded_forward`): one quantized layer's forward after sharding
must equal, bit for bit, the same layer's forward before sharding, and every quantized layer's gathered packed bytes
must equal the loaded ones, or training is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from hfsdp.errors import UserError
from hfsdp.rules.quantization import settings

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


def linears_to_quantize(model) -> list:
    """The nn.Linear modules transformers' bitsandbytes integration replaces: every one but the output head (and
    the adapters peft adds)."""
    import torch

    head = model.get_output_embeddings()
    return [m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name]


def quantized_linears(model) -> list[tuple[str, Any]]:
    """(name, module) of every bitsandbytes 4-bit Linear in ``model``."""
    from bitsandbytes.nn import Linear4bit

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear4bit)]


def keep_packing(model) -> None:
    """bitsandbytes' CPU inference path (AVX512-BF16 CPUs, eval mode) repacks a 4-bit weight in place on its first
    forward, rewriting the gathered copy FSDP frees and the quant state all shards share: switched off."""
    for _, module in quantized_linears(model):
        module.support_avx512bf16_for_cpu = False


@dataclass
class LayerProbe:
    """Taken before sharding: one quantized Linear's output on a fixed input, and every quantized Linear's packed
    bytes as a fingerprint; :func:`hfsdp.parallel.quantized_base.check_sharded_forward` compares them after."""

    name: str
    x: Any
    expected: Any
    fingerprints: dict[str, int]


def fingerprint(weight) -> int:
    """A position-weighted sum of the packed bytes (a changed byte, a NaN canonicalised, changes it)."""
    import torch

    data = weight.detach().contiguous().view(-1).view(torch.uint8).long()
    return int((data * (torch.arange(data.numel()) % 251 + 1)).sum())


def probe_before_sharding(model) -> LayerProbe | None:
    """Switch off in-place repacking (:func:`keep_packing`), then take the probe (:class:`LayerProbe`)."""
    import torch

    keep_packing(model)
    layers = quantized_linears(model)
    if not layers:
        return None
    name, module = layers[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, module.in_features, generator=generator).to(module.compute_dtype or torch.float32)
    with torch.no_grad():
        expected = module(x).clone()
    return LayerProbe(name, x, expected, {n: fingerprint(m.weight) for n, m in layers})


def _layer_name(name: str) -> str:
    """A 4-bit Linear's name in the base model, from its name in the peft model (or in the base itself)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


class DequantizedBase(Mapping):
    """A QLoRA run's full state dict as exports read it: each packed 4-bit weight dequantized (lazily, one tensor
    at a time) into its weights in the compute dtype, and bitsandbytes' quant-state entries (``<layer>.weight.absmax``
    and the like, which a model without a wrapper has in its state dict) left out. ``layers()`` gives the 4-bit
    Linears whose quant state dequantizes them: the trained model's own, or a base loaded again for ``hfsdp export``,
    which must then hold the same packed bytes (else UserError: not the base this run trained on)."""

    def __init__(self, state_dict: Mapping[str, Any], layers: Callable[[], dict[str, Any]], compute_dtype: str,
                 check_bytes: bool):
        self.sd, self._layers, self._by_name = state_dict, layers, None
        self.compute_dtype, self.check_bytes = compute_dtype, check_bytes
        self.keys_ = [k for k in state_dict if ".weight." not in k]  # no ordinary weight name has it

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __getitem__(self, key: str):
        import torch
        from bitsandbytes.functional import dequantize_4bit

        tensor = self.sd[key]
        if not key.endswith(".weight"):
            return tensor
        if self._by_name is None:
            self._by_name = {_layer_name(n): m for n, m in self._layers().items()}
        layer = self._by_name.get(_layer_name(key.removesuffix(".weight")))
        if layer is None:
            return tensor
        if self.check_bytes and fingerprint(tensor) != fingerprint(layer.weight):
            raise UserError(f"export: {key} holds other 4-bit bytes than the base model loaded for the merge: the "
                            "base (model.name_or_path) changed since this run trained on it")
        state = getattr(layer.weight, "quant_state", None) or layer.quant_state
        return dequantize_4bit(tensor.contiguous(), state).to(getattr(torch, self.compute_dtype))


def exported_weights(state_dict: Mapping[str, Any], config: "HfsdpConfig", layers: Callable[[], dict[str, Any]],
                     check_bytes: bool) -> Mapping[str, Any]:
    """What the export hooks receive: ``state_dict`` as it is, or for QLoRA :class:`DequantizedBase`."""
    q = settings(config)
    return state_dict if q is None else DequantizedBase(state_dict, layers, q.compute_dtype, check_bytes)


def base_not_in_cache(name_or_path: str) -> str | None:
    """Why the base model cannot be loaded again for a merged export without the network, or None if it can: a
    built-in or local model always can; a hub id only once it is in the local Hugging Face cache."""
    from pathlib import Path

    from hfsdp.model.loading import BUILTIN_MODELS

    if name_or_path in BUILTIN_MODELS or Path(name_or_path).expanduser().exists():
        return None
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(name_or_path, local_files_only=True)
        return None
    except Exception:  # LocalEntryNotFoundError, a malformed id
        return (f"the merged export of a 4-bit base dequantizes the weights with the base's quantization state, so "
                f"it loads the base again: '{name_or_path}' is not in the local Hugging Face cache (and hfsdp "
                "export does not download). Download it first (huggingface-cli download "
                f"{name_or_path}), set model.name_or_path to a local copy with --set, or export the adapter "
                "(without --merge-lora)")
