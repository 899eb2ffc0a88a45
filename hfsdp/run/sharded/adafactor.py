"""torch's Adafactor on FSDP2's shards (:class:`ShardedAdafactor`)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim._adafactor import adafactor


class ShardedAdafactor(torch.optim.Adafactor):
    """torch's Adafactor; on FSDP2's sharded parameters (DTensors) it runs on the gathered parameter and gradient
    (its update needs each matrix's column means and the whole parameter's and update's norms), so the update
    is one process's, and each rank keeps its own rows of the result, as :class:`WholeMatrixMuon` does. The
    state stays sharded where it follows the parameter's rows: a matrix's row factor (rows x 1) and a vector's
    second moment are sharded as the parameter is and gathered for the step (a rows-sized all-gather); the
    column factor (1 x columns), the same on every rank, is kept whole on each."""

    def _init_group(self, group, *lists):
        for p in group["params"]:
            if p.grad is not None and isinstance(p, DTensor) and not self.state.get(p):
                self.state[p] = self._sharded_state(p)
        return super()._init_group(group, *lists)

    @staticmethod
    def _sharded_state(p) -> dict:
        """torch's initial state of ``p`` (zeros; step 0) as DTensors."""
        from torch.optim.optimizer import _get_scalar_dtype

        state = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype())}
        local = p.to_local()
        if p.dim() > 1:
            rows = [*p.shape[:-1], 1]
            state["row_var"] = DTensor.from_local(local.new_zeros([*local.shape[:-1], 1]), p.device_mesh,
                                                  p.placements, run_check=False, shape=torch.Size(rows),
                                                  stride=torch.empty(rows, device="meta").stride())
            state["col_var"] = DTensor.from_local(local.new_zeros([*p.shape[:-2], 1, p.shape[-1]]),
                                                  p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                  run_check=False)
        else:
            state["variance"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """torch's Adafactor.step, the sharded tensors gathered before torch's update and their own part kept
        after it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, row_vars, col_vars, variances, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
            back = []  # (sharded tensor, its gathered copy that the update changes)
            for i, p in enumerate(params):
                if not isinstance(p, DTensor):
                    continue
                params[i], grads[i] = p.full_tensor(), grads[i].full_tensor()
                back.append((p, params[i]))
                for tensors in (row_vars, variances):
                    if tensors[i] is not None:
                        back.append((tensors[i], tensors[i].full_tensor()))
                        tensors[i] = back[-1][1]
                if col_vars[i] is not None:
                    col_vars[i] = col_vars[i].to_local()  # whole on every rank
            eps1, eps2 = group["eps"]
            adafactor(params, grads, row_vars, col_vars, variances, steps, d=group["d"], lr=group["lr"],
                      beta2_decay=group["beta2_decay"], weight_decay=group["weight_decay"], eps1=eps1,
                      eps2=eps2, foreach=group["foreach"], maximize=group["maximize"],
                      grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                      has_complex=has_complex)
            for sharded, whole in back:
                # every rank holds the same whole result: each keeps its own part, without communication
                sharded.to_local().copy_(distribute_tensor(whole, sharded.device_mesh, sharded.placements,
                                                           src_data_rank=None).to_local())
        return loss
