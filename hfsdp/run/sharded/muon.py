"""torch's Muon on FSDP2's shards, with AdamW for what Muon does not take (:class:`WholeMatrixMuon`)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import _muon
from torch.optim.adamw import adamw


class WholeMatrixMuon(torch.optim.Muon):
    """torch's Muon for the groups marked ``use_muon`` (the hidden 2-D matrices) and AdamW for the others, in one
    optimizer (one state to checkpoint and verify). On FSDP2's sharded matrices (DTensors) Newton-Schulz runs on
    the gathered momentum, and each rank keeps its own rows of the result: the update one process makes.
    ``betas`` and ``eps`` are the AdamW groups'; ``ns_eps`` is Muon's own ``eps`` (its Newton-Schulz floor)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, ns_eps: float = 1e-7):
        params = list(params)
        super().__init__([g for g in params if g.get("use_muon")] or [{"params": [], "use_muon": True}], lr=lr,
                         weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_coefficients=ns_coefficients, eps=ns_eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        for group in params:
            if not group.get("use_muon"):  # Muon's constructor checks only its own groups for 2-D
                self.add_param_group({**group, "use_muon": False, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        return loss

    def _muon_step(self, group) -> None:
        """torch.optim._muon._single_tensor_muon, Newton-Schulz on the whole matrix."""
        params, grads, bufs = [], [], []
        self._init_group(group, params, grads, bufs)
        lr, momentum = _muon._to_scalar(group["lr"]), group["momentum"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        for param, grad, buf in zip(params, grads, bufs):
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if isinstance(update, DTensor):
                whole = _muon._zeropower_via_newtonschulz(update.full_tensor(), *ns)
                # every rank holds the same whole result: each keeps its own part, without communication
                update = distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
            else:
                update = _muon._zeropower_via_newtonschulz(update, *ns)
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-_muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape))

    def _adamw_step(self, group) -> None:
        """torch's AdamW (its single-tensor path) on the embeddings, the head, norms and biases."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
