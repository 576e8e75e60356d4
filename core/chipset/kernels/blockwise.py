"""Blockwise attention: one block of keys at a time, returning the log-sum-exp to merge with.

``attention_block(q, k, v, mask=None, causal=False, scale=None) -> (out, lse)`` is softmax
attention of ``q`` over this block of keys only: ``out`` in ``q``'s dtype, ``lse`` the
float32 log of each query's softmax denominator (``-inf`` for a query that sees no key of
the block, whose ``out`` row is 0). Outputs of several blocks of the same queries combine
exactly: ``lse = logaddexp(lse_1, lse_2)``, ``out = out_1 exp(lse_1 - lse) + out_2 exp(lse_2 - lse)``
(:func:`merge_blocks`). ``attention_block_backward(do, q, k, v, out, lse, ...)`` returns
``(dq, dk, dv)`` of this block given the *merged* ``out`` and ``lse`` of all blocks (the
softmax probabilities of the block are ``exp(q k^T scale - lse)``), so a caller sums the
blocks' contributions without ever holding the whole score matrix.

Shapes ``(batch, heads, seq, head_dim)``; ``k`` and ``v`` have as many heads as ``q`` (the
caller repeats grouped kv heads). ``causal``: square blocks only, query ``i`` sees keys
``j <= i``. ``mask``: bool, True = attend, broadcastable to ``(b, h, sq, sk)``. ``docs``:
``(q_docs, k_docs)``, document ids ``(b, sq)`` and ``(b, sk)``: a query sees only keys of
its own document (document masks, without an ``sq x sk`` mask in memory).

The references walk the queries in tiles of as many rows as keep a tile's float32 scores
within :data:`TILE_SCORES` elements (over batch and heads), so what they hold at once is
bounded whatever the block's length; a backend registers a fused kernel under the same
names (the cpu plugin: torch's flash attention for CPU).
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_block", "attention_block_backward", "merge_blocks", "BlockAttention", "TILE_SCORES"]

TILE_SCORES = 1 << 21
"""Score elements (batch x heads x rows x keys) the references hold at once: 8 MiB in float32."""


def _tiles(q, k):
    rows = max(1, TILE_SCORES // max(1, q[..., 0, 0].numel() * k.shape[-2]))
    for lo in range(0, q.shape[-2], rows):
        yield lo, min(lo + rows, q.shape[-2])


def _scores(q, k, mask, causal, scale, lo, docs=None):
    """A tile's float32 scores, masked in place: one tile-sized tensor (and the masks' booleans)."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)).mul_(scale)
    if docs is not None:
        qd, kd = docs
        other = qd[:, lo:lo + q.shape[-2]].unsqueeze(-1) != kd.unsqueeze(-2)
        s.masked_fill_(other.unsqueeze(1), float("-inf"))
        del other
    if causal:
        rows = torch.arange(lo, lo + q.shape[-2], device=q.device).unsqueeze(1)
        s.masked_fill_(torch.arange(k.shape[-2], device=q.device).unsqueeze(0) > rows, float("-inf"))
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def _tile_mask(mask, lo, hi):
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask[..., lo:hi, :]


def _check(q, k, causal):
    if k.shape[-3] != q.shape[-3]:
        raise ValueError(f"attention_block: k has {k.shape[-3]} heads, q {q.shape[-3]}; repeat grouped kv heads first")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention_block: causal needs a square block, found {q.shape[-2]} queries x {k.shape[-2]} keys")


def attention_block(q, k, v, mask=None, causal=False, scale=None, docs=None):
    """``(out, lse)`` of ``q`` over one block of keys (module docstring)."""
    _check(q, k, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for lo, hi in _tiles(q, k):
        s = _scores(q[..., lo:hi, :], k, _tile_mask(mask, lo, hi), causal, scale, lo, docs)
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        outs.append(torch.matmul(s.sub_(safe.unsqueeze(-1)).exp_(), v.float()))  # in place: one tile alive
        lses.append(lse)
        del s
    return torch.cat(outs, -2).to(q.dtype), torch.cat(lses, -1)


def attention_block_backward(do, q, k, v, out, lse, mask=None, causal=False, scale=None, docs=None):
    """``(dq, dk, dv)`` of one block, from the merged ``out`` and ``lse`` (module docstring)."""
    _check(q, k, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kf, vf = k.float(), v.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for lo, hi in _tiles(q, k):  # two tile-sized tensors alive at most: the probabilities and their gradient
        qt, dot = q[..., lo:hi, :].float(), do[..., lo:hi, :].float()
        lt = lse[..., lo:hi]
        p = _scores(qt, kf, _tile_mask(mask, lo, hi), causal, scale, lo, docs)
        p.sub_(torch.where(torch.isinf(lt), torch.zeros_like(lt), lt).unsqueeze(-1)).exp_()
        delta = (dot * out[..., lo:hi, :].float()).sum(-1, keepdim=True)
        dv += p.transpose(-2, -1) @ dot
        ds = torch.matmul(dot, vf.transpose(-2, -1)).sub_(delta).mul_(p)
        del p
        dq[..., lo:hi, :] = ds @ kf * scale
        dk += ds.transpose(-2, -1) @ qt * scale
        del ds
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_blocks(out, lse, blk_out, blk_lse):
    """Merge a block's ``(blk_out, blk_lse)`` into the running float32 ``(out, lse)``; rows
    that saw no key anywhere yet stay 0 with ``lse = -inf``."""
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(blk_lse - safe).unsqueeze(-1)
    return out * a + blk_out.float() * b, new


class BlockAttention(torch.autograd.Function):
    """Attention through the ``attention_block`` kernels, differentiable: forward keeps the
    output and log-sum-exp, backward calls ``attention_block_backward`` (no score matrix kept)."""

    @staticmethod
    def forward(ctx, q, k, v, kernels, docs, causal):
        out, lse = kernels.attention_block(q, k, v, causal=causal, docs=docs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.docs, ctx.causal = kernels, docs, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernels.attention_block_backward(do.to(q.dtype), q, k, v, out, lse,
                                                          causal=ctx.causal, docs=ctx.docs)
        return dq, dk, dv, None, None, None
