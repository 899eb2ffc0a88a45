"""The 4-bit base of QLoRA (:mod:`hfsdp.model.quantized` loads it) once the model is sharded: the start-up probe
(:func:`check_sharded_forward`: one quantized layer's forward after sharding must equal, bit for bit, its forward
before, taken by :func:`hfsdp.model.quantized.probe_before_sharding`, and every quantized layer's gathered packed bytes
the loaded ones, or training is refused) and what the base costs this rank (:func:`base_report`: the packed bytes it
holds of the whole, and the quantization state every rank keeps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfsdp.errors import UserError
from hfsdp.model.quantized import LayerProbe, fingerprint, quantized_linears
from hfsdp.parallel.world import any_rank, local_tensor

if TYPE_CHECKING:
    from hfsdp.rules.quantization import QuantSettings


def _owners(model) -> dict[int, Any]:
    """id(module) -> the FSDP2 unit whose all-gather holds that module's parameters (None: not sharded), for every
    module of ``model``. Walked over the real module tree: a wrapper that forwards attribute access (activation
    checkpointing's ``CheckpointWrapper``) makes a dotted name resolve past the unit it hides, so an ancestor found
    by splitting the name would be the wrong one."""
    from torch.distributed.fsdp import FSDPModule

    owners: dict[int, Any] = {}
    stack = [(model, None)]
    while stack:
        module, owner = stack.pop()
        owner = module if isinstance(module, FSDPModule) else owner
        owners[id(module)] = owner
        stack.extend((child, owner) for child in module.children())
    return owners


def check_sharded_forward(model, probe: LayerProbe | None, accelerator) -> None:
    """The probe: in the sharded ``model`` (each FSDP unit gathered in turn), ``probe``'s layer must give the output
    it gave before sharding and every quantized layer its loaded packed bytes, bit for bit, on every rank; else
    UserError (nothing trained). Collective under FSDP: every rank gathers the same units in the same order."""
    import torch

    if probe is None:
        return
    owners = _owners(model)
    by_owner: dict[int, tuple[Any, list[str]]] = {}
    for name in probe.fingerprints:
        owner = owners[id(model.get_submodule(name))]
        by_owner.setdefault(id(owner), (owner, []))[1].append(name)
    changed: list[str] = []
    forward = ""
    with torch.no_grad():
        for owner, names in by_owner.values():
            if owner is not None:
                owner.unshard()
            try:
                changed += [n for n in names if fingerprint(model.get_submodule(n).weight) != probe.fingerprints[n]]
                if probe.name in names:
                    got = model.get_submodule(probe.name)(probe.x.to(accelerator.device)).cpu()
                    if not torch.equal(got, probe.expected):
                        worst = float((got.float() - probe.expected.float()).abs().max())
                        forward = f"; {probe.name}'s forward differs by up to {worst:.3g}"
            finally:
                if owner is not None:
                    owner.reshard()
    if any_rank(accelerator, bool(changed or forward)):
        where = (f"on rank {accelerator.process_index}: {len(changed)} layer(s) with other packed bytes"
                 f"{', e.g. ' + changed[0] if changed else ''}{forward}"
                 if changed or forward else "on another rank")
        raise UserError(
            f"model.quantization: the 4-bit weights did not survive sharding ({where}); nothing was trained "
            "(bitsandbytes #1945: GPU all-gathers can canonicalise the NaN bit patterns of bf16-stored packed "
            "data). Set model.quantization.quant_storage: "
            "uint8 (the 4-bit base then stays whole on every rank), or float32")


def quant_state_bytes(module) -> int:
    """Bytes of a 4-bit Linear's quantization state (absmax, code book; nested ones with double quantization)."""
    state = getattr(module.weight, "quant_state", None) or module.quant_state
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors)


def base_report(model, q: QuantSettings) -> dict[str, Any]:
    """What the 4-bit base costs this rank: packed bytes held (of the full packed bytes), whether FSDP shards them,
    and the quantization state (on every rank: it lives on the modules)."""
    from torch.distributed.tensor import DTensor

    layers = [m for _, m in quantized_linears(model)]
    return {
        "quant_type": q.quant_type, "double_quant": q.double_quant, "quant_storage": q.quant_storage,
        "compute_dtype": q.compute_dtype, "layers": len(layers),
        "packed_bytes_this_rank": sum(local_tensor(m.weight).numel() * m.weight.element_size() for m in layers),
        "packed_bytes_full": sum(m.weight.numel() * m.weight.element_size() for m in layers),
        "sharded": any(isinstance(m.weight, DTensor) for m in layers),
        "quant_state_bytes": sum(quant_state_bytes(m) for m in layers),
    }


def format_base_report(report: dict[str, Any], peak_rss_bytes: int) -> str:
    mib = 1024**2
    how = ("sharded by FSDP2" if report["sharded"] else
           "whole on every rank: uint8 storage is kept out of FSDP2 (Accelerate's ignored_params); a floating "
           "quant_storage shards it")
    return (f"  4-bit base: {report['layers']} {report['quant_type']} Linears"
            f"{', double quant' if report['double_quant'] else ''}, stored {report['quant_storage']}, compute "
            f"{report['compute_dtype']}: {report['packed_bytes_this_rank'] / mib:.1f} of "
            f"{report['packed_bytes_full'] / mib:.1f} MiB packed on this rank ({how}) + "
            f"{report['quant_state_bytes'] / mib:.2f} MiB quant state (on every rank); checked after sharding; "
            f"peak host memory so far {peak_rss_bytes / mib:.0f} MiB")
