"""bitsandbytes' AdamW8bit on FSDP2's shards (:class:`ShardedAdamW8bit`)."""

from __future__ import annotations

import math

import torch
from bitsandbytes.optim import AdamW8bit
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from hfsdp.parallel.world import local_tensor
from hfsdp.rules.optimizers import BNB_BLOCK
from hfsdp.run.optimizers import blocks_follow_shards


class ShardedAdamW8bit(AdamW8bit):
    """bitsandbytes' ``AdamW8bit``, its own state layout and kernels, on FSDP2's sharded parameters (DTensors)
    with one process's update. Whether a parameter's moments are 8-bit is decided by the whole parameter's size
    (bitsandbytes' ``min_8bit_size``), as on one process. Moments in 32 bits are elementwise: each rank updates
    its shard. 8-bit moments are quantized in blocks of 256 elements of the flattened parameter; FSDP2 shards on
    dim 0, so a rank's shard is a contiguous range of it: where that range starts and ends on block boundaries
    (:func:`blocks_follow_shards`), the rank quantizes its own blocks (its moments and their block scales are
    sharded as the parameter is). Elsewhere every rank runs the kernels on the gathered parameter and gradient,
    with the whole (replicated) moments, and keeps its own rows of the result, as :class:`WholeMatrixMuon`
    does. On plain tensors (one process, DDP) it is ``AdamW8bit`` itself."""

    def init_state(self, group, p, gindex, pindex):
        super().init_state(group, p, gindex, pindex)  # the 8-bit choice by p.numel(): a DTensor's is the whole's
        state = self.state[p]
        if not isinstance(p, DTensor) or state["state1"].dtype != torch.uint8:
            return  # 32-bit moments: zeros_like(p), sharded as p is
        mesh, placements = p.device_mesh, p.placements
        shards = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())
        if all(pl.is_replicate() or pl.is_shard(0) for pl in placements) and blocks_follow_shards(p.shape, shards):
            local = local_tensor(p).numel()
            for key in ("absmax1", "absmax2"):
                state[key] = DTensor.from_local(
                    torch.zeros(-(-local // BNB_BLOCK), dtype=torch.float32, device=p.device), mesh, placements,
                    run_check=False, shape=state[key].shape, stride=(1,))
        else:
            whole = [Replicate()] * mesh.ndim
            for key in ("state1", "state2", "absmax1", "absmax2"):
                shape = p.shape if key.startswith("state") else state[key].shape
                dtype = state[key].dtype
                state[key] = DTensor.from_local(torch.zeros(shape, dtype=dtype, device=p.device), mesh, whole,
                                                run_check=False)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        if not isinstance(p, DTensor):
            return super().update_step(group, p, gindex, pindex)
        state = self.state[p]
        gathered = (state["state1"].placements != p.placements
                    and all(pl.is_replicate() for pl in state["state1"].placements))
        shard = p.to_local()
        # bitsandbytes' own update_step on plain tensors: this rank's shard, or the gathered parameter
        param = (p.full_tensor() if gathered else shard).detach()
        param.grad = (p.grad.full_tensor() if gathered else p.grad.to_local())
        self.state[param] = {key: local_tensor(v) if torch.is_tensor(v) else v for key, v in state.items()}
        try:
            super().update_step(group, param, gindex, pindex)
        finally:
            state["step"] = self.state.pop(param)["step"]
        if gathered:
            # every rank holds the same whole result: each keeps its own part, without communication
            param = distribute_tensor(param, p.device_mesh, p.placements, src_data_rank=None).to_local()
        if param.data_ptr() != shard.data_ptr():
            shard.copy_(param)
