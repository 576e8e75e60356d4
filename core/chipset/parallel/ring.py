"""Ring attention over the cp group, one fused attention block per step.

Each step attends this rank's queries to the K/V block it holds, through the backend's
``attention_block`` kernel (kernels/blockwise.py: a fused kernel returning the log-sum-exp,
or the tiled reference), and merges the result by log-sum-exp, while the block moves on to
the next rank (batched send/recv overlapping the step). Memory per step is the kernel's:
O(block) for a fused kernel, O(tile x block) for the reference, never the block's score matrix.

With the load-balanced layout (cp rank ``i`` holds chunks ``i`` and ``2cp-1-i``) no step
needs a mask: the own block is causal over the local tokens (their positions increase), a
block from an earlier rank ``j < i`` is seen whole by all local queries through its first
chunk only, and one from a later rank ``j > i`` by the local second chunk only, whole.
Document masks (``docs``, the whole sequence's document ids) hand each step's query and key ids to
the kernel, which masks tile by tile (no block x block mask in memory).

Backward circulates the blocks again with their gradient accumulators and calls
``attention_block_backward`` with the merged output and log-sum-exp, so each block's share
of the gradient is exact; the last hop brings the finished K/V gradients to their owners.
"""

from __future__ import annotations

import torch

from chipset.interfaces import P2POp
from chipset.kernels.blockwise import merge_blocks

__all__ = ["ring_attention"]


def _rotate(cp, t: torch.Tensor):
    """Send ``t`` to the next cp rank and receive the previous rank's into a new buffer (async)."""
    nxt = cp.group.ranks[(cp.rank + 1) % cp.size]
    prv = cp.group.ranks[(cp.rank - 1) % cp.size]
    buf = torch.empty_like(t)
    handles = cp.collective.batch_p2p([P2POp("send", t, nxt, cp.group), P2POp("recv", buf, prv, cp.group)])
    return buf, handles


def _wait(handles) -> None:
    """Wait for a rotation; clears ``handles``, whose work objects keep the sent block alive."""
    for h in handles:
        h.wait()
    handles.clear()


def expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def fold_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Sum the gradient of repeated kv heads back onto each kv head."""
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


def _step(cp, src: int, s_local: int, docs, s: int):
    """(query rows, key columns, causal, document ids of both or None) of the step that holds ``src``'s block."""
    c = s_local // 2
    every = slice(0, s_local)
    if src == cp.rank:
        rows, cols, causal = every, every, True
    elif src < cp.rank:
        rows, cols, causal = every, slice(0, c), False
    else:
        rows, cols, causal = slice(c, s_local), every, False
    pair = None
    if docs is not None:  # document ids of the step's queries and keys (kernels/blockwise.py ``docs``)
        pair = (docs[:, cp.positions(s, docs.device)[rows]], docs[:, cp.positions_of(src, s, docs.device)[cols]])
    return rows, cols, causal, pair


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, docs):
        s_local = q.shape[2]
        s = s_local * cp.size
        rep = q.shape[1] // k.shape[1]
        kern = cp.kernels
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp.size):
            pending = _rotate(cp, kv) if step < cp.size - 1 else None
            rows, cols, causal, pair = _step(cp, (cp.rank - step) % cp.size, s_local, docs, s)
            kk, vv = expand_kv(kv[0][:, :, cols], rep), expand_kv(kv[1][:, :, cols], rep)
            qq = q[:, :, rows]
            blk_o, blk_lse = kern.attention_block(qq, kk, vv, causal=causal, docs=pair)
            o[:, :, rows], lse[:, :, rows] = merge_blocks(o[:, :, rows], lse[:, :, rows], blk_o, blk_lse)
            del kk, vv, blk_o, blk_lse
            if pending is not None:
                buf, handles = pending
                _wait(handles)
                kv = buf
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs if docs is not None else torch.empty(0))
        ctx.cp, ctx.has_docs = cp, docs is not None
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, docs = ctx.saved_tensors
        docs = docs if ctx.has_docs else None
        cp = ctx.cp
        kern = cp.kernels
        s_local = q.shape[2]
        s = s_local * cp.size
        rep = q.shape[1] // k.shape[1]
        do = do.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # Each block travels with its gradient accumulators: (k, v, dk, dv), in float32.
        blk = torch.stack([k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
                           torch.zeros_like(v, dtype=torch.float32)]).contiguous()
        for step in range(cp.size):
            rows, cols, causal, pair = _step(cp, (cp.rank - step) % cp.size, s_local, docs, s)
            kk = expand_kv(blk[0][:, :, cols].to(k.dtype), rep)
            vv = expand_kv(blk[1][:, :, cols].to(v.dtype), rep)
            dqq, dkk, dvv = kern.attention_block_backward(
                do[:, :, rows], q[:, :, rows], kk, vv, out[:, :, rows], lse[:, :, rows], causal=causal, docs=pair)
            dq[:, :, rows] += dqq.float()
            blk[2][:, :, cols] += fold_kv(dkk.float(), rep)
            blk[3][:, :, cols] += fold_kv(dvv.float(), rep)
            del kk, vv, dqq, dkk, dvv  # not alive during the next step's kernel
            if step < cp.size - 1:
                buf, handles = _rotate(cp, blk)
            else:  # the last hop brings the finished gradients home
                buf, handles = _rotate(cp, blk[2:].contiguous())
            _wait(handles)
            blk = buf
        return dq.to(q.dtype), blk[0].to(k.dtype), blk[1].to(v.dtype), None, None


def ring_attention(q, k, v, cp, docs=None):
    """Causal attention of this rank's queries over the whole sequence, around the cp ring."""
    return _RingAttention.apply(q, k, v, cp, docs)
