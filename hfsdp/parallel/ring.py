"""Ring attention (``parallel.cp_size``, context parallelism): the ranks of a ring hold consecutive shares of every
row's positions (rank ``i`` of ``cp`` the ``i``-th), and each attends its queries to every share's keys and values,
which pass around the ring a share at a time (:class:`RingAttention`), so that no rank holds a whole row's keys and
values, and the heads need not divide by anything (Ulysses, :mod:`hfsdp.parallel.sequence`, splits them).

What keeps it exact: causal attention over consecutive shares sees the shares before its own whole, its own under the
causal mask and none after it; a packed row's sequences attend each within itself (the mask of their spans in row
coordinates); the shares' partial results merge by their log-sum-exps (as flash attention merges its blocks), in
float32; the backward passes the shares around again, each with the gradient of its keys and values gathering the
ranks' contributions on its way back to its owner. Every block is computed from its scores in float32, a tile of
queries at a time (its memory is a tile's scores, never a row's square).

The passes are all-to-alls that send to the next rank and receive from the one before (torch's context parallel
rotates with all-to-all too), started before each block's compute and waited after it; gloo has them, so CPU ranks
rehearse the ring exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# scores computed at once for a tile of queries (batch x heads x tile x keys elements, float32): 256 MiB
TILE_SCORES = 1 << 26


@dataclass(frozen=True)
class Ring:
    """A ring of ``size`` ranks (``group``), this rank its ``rank``-th: it holds that share of each row's positions
    (of the positions the attention sees: a sequence-parallel group's, where Ulysses gathers them first)."""

    group: Any
    size: int
    rank: int


def _rotate(flat: torch.Tensor, ring: Ring):
    """Start sending ``flat`` to the next rank of the ring and receiving the previous one's (the same size): the
    buffer it lands in, and the work to wait for."""
    import torch.distributed as dist

    out = torch.empty_like(flat)
    n = flat.numel()
    send = [n if r == (ring.rank + 1) % ring.size else 0 for r in range(ring.size)]
    receive = [n if r == (ring.rank - 1) % ring.size else 0 for r in range(ring.size)]
    work = dist.all_to_all_single(out, flat, receive, send, group=ring.group, async_op=True)
    return out, work


def _masks(ring: Ring, src: int, share: int, segments: torch.Tensor | None, device) -> tuple[bool, Any]:
    """Whether this rank's queries see any of share ``src``'s keys, and the mask they see them under: None (all of
    them: an earlier share), "causal" (its own share), or a boolean ``[rows, 1, queries, keys]`` mask (packed rows:
    ``segments``, each position's sequence in row coordinates)."""
    if src > ring.rank:
        return False, None
    if segments is None:
        return True, "causal" if src == ring.rank else None
    q = torch.arange(ring.rank * share, (ring.rank + 1) * share, device=device)
    k = torch.arange(src * share, (src + 1) * share, device=device)
    same = segments[:, q, None] == segments[:, None, k]
    return True, (same & (q[:, None] >= k[None, :]))[:, None]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask, first: int) -> torch.Tensor:
    """A tile's scores (queries ``q`` from the tile's ``first`` query of the share on), masked to -inf: ``q``
    ``[rows, kv heads, group, tile, dim]``, ``k`` ``[rows, kv heads, 1, keys, dim]``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        return s
    if isinstance(mask, str):  # causal within the same share
        tile, keys = s.shape[-2], s.shape[-1]
        rows = torch.arange(first, first + tile, device=s.device)
        allowed = rows[:, None] >= torch.arange(keys, device=s.device)[None, :]
    else:
        allowed = mask[:, :, first:first + s.shape[-2]].unsqueeze(1)
    return s.masked_fill(~allowed, float("-inf"))


def _tiles(q: torch.Tensor, keys: int):
    """Query tiles of ``q`` (``[rows, kv heads, group, queries, dim]``) whose scores are at most :data:`TILE_SCORES`."""
    per = max(1, TILE_SCORES // max(1, q.shape[0] * q.shape[1] * q.shape[2] * keys))
    for first in range(0, q.shape[-2], per):
        yield first, min(first + per, q.shape[-2])


def _block_forward(q, k, v, scale, mask):
    """Attention of ``q`` over one share's keys and values, float32: the output ``[rows, kv heads, group, queries,
    dim]`` (0 where no key is visible) and the log-sum-exp of each query's scores (-inf there)."""
    outs, lses = [], []
    for a, b in _tiles(q, k.shape[-2]):
        s = _scores(q[..., a:b, :], k, scale, mask, a)
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        p = torch.exp(s - top)
        total = p.sum(-1, keepdim=True)
        outs.append(torch.matmul(p, v) / total.clamp_min(torch.finfo(total.dtype).tiny))
        lses.append((top + torch.log(total)).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _block_backward(dout, q, k, v, lse, delta, scale, mask):
    """The gradients of one share's block: of the queries, and of the share's keys and values (summed over the
    query heads that share them), from the attention's whole output's ``lse`` and ``delta`` (rowsum of the output
    gradient times the output), as flash attention's backward computes each block."""
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for a, b in _tiles(q, k.shape[-2]):
        s = _scores(q[..., a:b, :], k, scale, mask, a)
        p = torch.exp(s - lse[..., a:b, None])
        do = dout[..., a:b, :]
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2, keepdim=True)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., a:b, None])
        dq[..., a:b, :] = torch.matmul(ds, k) * scale
        dk += (torch.matmul(ds.transpose(-1, -2), q[..., a:b, :]) * scale).sum(2, keepdim=True)
    return dq, dk, dv


def _unpack(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A share's keys and values (or their gradients) from one flat tensor, in float32, shaped for the blocks:
    ``[rows, kv heads, 1, share, dim]``."""
    n = k.numel()
    return (flat[:n].view(k.shape).float().unsqueeze(2), flat[n:].view(v.shape).float().unsqueeze(2))


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's share of queries over every share's keys and values around ``ring``:
    ``q`` ``[rows, heads, share, dim]``, ``k`` and ``v`` ``[rows, kv heads, share, dim]`` (kv heads dividing heads);
    ``segments``: each position's sequence in row coordinates (``[rows, share x ring size]``) for packed rows, else
    None. The output ``[rows, heads, share, dim]`` in ``q``'s dtype."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, segments):
        rows, heads, share, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        qf = q.float().reshape(rows, kv_heads, group, share, dim)
        out = torch.zeros(rows, kv_heads, group, share, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((rows, kv_heads, group, share), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k.flatten(), v.flatten()])  # passed on in their own dtype, computed with in float32
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                arrived, work = _rotate(kv, ring)
            visible, mask = _masks(ring, src, share, segments, q.device)
            if visible:
                kf, vf = _unpack(kv, k, v)
                block, block_lse = _block_forward(qf, kf, vf, scale, mask)
                merged = torch.logaddexp(lse, block_lse)
                finite = torch.isfinite(merged)
                keep = torch.where(finite, torch.exp(lse - merged), torch.zeros_like(merged))
                add = torch.where(finite, torch.exp(block_lse - merged), torch.zeros_like(merged))
                out = out * keep[..., None] + block * add[..., None]
                lse = merged
            if step < ring.size - 1:
                work.wait()
                kv = arrived
        ctx.ring, ctx.scale, ctx.segments = ring, scale, segments
        out = out.to(q.dtype)  # kept in the inputs' dtype, as the fused kernels keep it
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(rows, heads, share, -1)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        rows, heads, share, dim = q.shape
        kv_heads = k.shape[1]
        qf = q.float().reshape(rows, kv_heads, heads // kv_heads, share, dim)
        dout = grad.float().reshape(out.shape)
        delta = (dout * out.float()).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.cat([k.flatten(), v.flatten()])
        dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=kv.device)  # the share's gradients so far
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            visible, mask = _masks(ring, src, share, ctx.segments, q.device)
            if visible:
                kf, vf = _unpack(kv, k, v)
                dq_b, dk_b, dv_b = _block_backward(dout, qf, kf, vf, lse, delta, scale, mask)
                dq += dq_b
                dkv += torch.cat([dk_b.flatten(), dv_b.flatten()])
            # the share and its gradients go on to the next rank (two passes); after the last step the gradients
            # alone, to the next rank, which owns them
            if step < ring.size - 1:
                (kv, kv_work), (dkv, dkv_work) = _rotate(kv, ring), _rotate(dkv, ring)
                kv_work.wait()
            else:
                dkv, dkv_work = _rotate(dkv, ring)
            dkv_work.wait()
        dk, dv = _unpack(dkv, k, v)
        return (dq.reshape(q.shape).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype),
                None, None, None)


def segment_ids(segments: list[list[tuple[int, int]]], width: int, device) -> torch.Tensor:
    """Each position's sequence (its index in the row's spans; -1 past them: padding) of rows ``width`` wide."""
    ids = torch.full((len(segments), width), -1, dtype=torch.long)
    for r, spans in enumerate(segments):
        for i, (a, b) in enumerate(spans):
            ids[r, a:b] = i
    return ids.to(device)


def ring_attention(module, query, key, value, ring: Ring, segments=None, **kwargs):
    """transformers' attention call (``query`` ``[rows, heads, share, dim]``, ``key``/``value`` with the KV heads)
    as :class:`RingAttention`; the output ``[rows, share, heads, dim]`` as transformers' attention functions give
    it. ``segments``: a packed row's sequences as (start, end) spans of the whole row."""
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None) or 1 / math.sqrt(query.shape[-1])
    ids = segment_ids(segments, query.shape[2] * ring.size, query.device) if segments is not None else None
    out = RingAttention.apply(query, key, value, ring, scale, ids)
    return out.transpose(1, 2).contiguous()
