"""Test-only hfsdp plugin: one byte of one packed 4-bit weight changes while FSDP2 shards the model, as bitsandbytes
#1945's NaN canonicalisation changes bf16-stored packed bytes; the start-up probe must refuse to train.

Enable it with ``plugins: [lora, hfsdp_corrupt_shard]`` and this folder on PYTHONPATH. It wraps the ``fully_shard``
that Accelerate imports, so it acts only inside ``accelerator.prepare``.
"""

import torch

from hfsdp import hookimpl

__version__ = "0.0.1"


def _corrupt_first_packed_shard(module) -> bool:
    from bitsandbytes.nn import Linear4bit
    from torch.distributed.tensor import DTensor

    for layer in module.modules():
        if isinstance(layer, Linear4bit) and isinstance(layer.weight, DTensor):
            local = layer.weight.to_local()
            if local.numel():
                local.view(-1).view(torch.uint8)[0] ^= 0xFF
                return True
    return False


@hookimpl
def hfsdp_modify_model(model):
    import torch.distributed.fsdp as fsdp  # Accelerate imports fully_shard from here when it prepares the model

    if getattr(fsdp.fully_shard, "corrupts", False):  # asked again (hfsdp asks for the meta model first, to
        return None                                      # estimate a checkpoint): a second wrapper would flip back
    original = fsdp.fully_shard
    done = []

    def fully_shard(module, *args, **kwargs):
        out = original(module, *args, **kwargs)
        if not done and _corrupt_first_packed_shard(module if isinstance(module, torch.nn.Module) else out):
            done.append(True)
        return out

    fully_shard.corrupts = True
    fsdp.fully_shard = fully_shard
    return None
