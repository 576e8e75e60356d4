"""Ulysses sequence parallelism: trade the sequence split for a head split around attention.

Each cp rank holds a share of every sequence and all heads. One all-to-all hands each rank
all tokens of ``heads / cp`` heads; it attends over the whole sequence with the backend's
fused block kernel (kernels/blockwise.py) and a second all-to-all returns every rank's
tokens of all heads. Communication is four all-to-alls of ``1/cp`` of q, k, v, out per layer
(and four in backward), independent of the ring's ``cp`` steps; the price is that heads
(after tp) must divide by cp.

Grouped-query attention: kv heads are repeated up to ``lcm(kv heads, cp)`` before the
all-to-all, so each rank receives exactly the kv heads its query heads read (autograd sums
the repeats' gradients back); with ``kv heads`` a multiple of cp nothing is repeated.
"""

from __future__ import annotations

import math

import torch

from chipset.errors import ConfigError
from chipset.kernels.blockwise import BlockAttention
from chipset.parallel.ring import expand_kv

__all__ = ["ulysses_attention", "split_heads"]


def _a2a(cp, inp: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(inp)
    cp.collective.all_to_all(out, inp, group=cp.group)
    return out


def _to_heads(cp, x: torch.Tensor) -> torch.Tensor:
    """(b, H, s_local, d) sequence-sharded -> (b, H/cp, cp*s_local, d) head-sharded, rank-major."""
    b, h, sl, d = x.shape
    n = cp.size
    out = _a2a(cp, x.reshape(b, n, h // n, sl, d).transpose(0, 1).contiguous())  # out[i]: rank i's tokens
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * sl, d)


def _to_seq(cp, y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_to_heads`."""
    b, hl, s, d = y.shape
    n = cp.size
    out = _a2a(cp, y.reshape(b, hl, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous())  # out[i]: rank i's heads
    return out.transpose(0, 1).reshape(b, n * hl, s // n, d)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _to_heads(cp, x)

    @staticmethod
    def backward(ctx, g):
        return _to_seq(ctx.cp, g.contiguous()), None


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, cp):
        ctx.cp = cp
        return _to_seq(cp, y)

    @staticmethod
    def backward(ctx, g):
        return _to_heads(ctx.cp, g.contiguous()), None


def split_heads(q, k, v, group, kind: str, size: str, fix: str):
    """``q, k, v`` of this rank's tokens (all heads) -> all of ``group``'s tokens of ``heads / group.size``
    heads (rank-major), kv heads repeated up to ``lcm(kv heads, group.size)`` first. ConfigError when the
    query heads do not divide: ``kind`` (the cp_attention), ``size`` (the key sizing the group) and ``fix``
    say so (a family whose own checks did not catch it; the transformer's do, before launch)."""
    n = group.size
    if q.shape[1] % n:
        raise ConfigError(f"cp_attention = '{kind}' splits heads over {size}: {q.shape[1]} query heads on this "
                          f"rank are not divisible by {size} ({n}); {fix}")
    grow = math.lcm(k.shape[1], n) // k.shape[1]
    k, v = expand_kv(k, grow), expand_kv(v, grow)
    return _ToHeads.apply(q, group), _ToHeads.apply(k, group), _ToHeads.apply(v, group)


def ulysses_attention(q, k, v, cp, docs=None):
    """Causal attention of this rank's tokens (all heads), computed head-parallel over the cp group."""
    qh, kh, vh = split_heads(q, k, v, cp, "ulysses", "cp", "choose another parallel.cp or cp_attention = 'ring'")
    s = qh.shape[2]
    order = cp.rank_major_positions(s, q.device)  # rank-major index -> global position
    inv = torch.argsort(order)
    qh, kh, vh = (t.index_select(2, inv) for t in (qh, kh, vh))  # sequence order
    rep = qh.shape[1] // kh.shape[1]
    kh, vh = expand_kv(kh, rep), expand_kv(vh, rep)
    out = BlockAttention.apply(qh, kh, vh, cp.kernels, None if docs is None else (docs, docs), True)
    return _ToSeq.apply(out.index_select(2, order), cp)
