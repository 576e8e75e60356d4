"""Context parallelism: each sequence is split across cp ranks; attention sees all of it.

Load-balanced layout: the sequence is cut into ``2*cp`` equal chunks and cp rank ``i`` holds
chunks ``i`` and ``2*cp-1-i`` (one early, one late), so under the causal mask every rank
has the same number of (query, key) pairs to attend.

Attention: each rank computes queries for its own tokens; keys and values are all-gathered
over the cp group (backward: their gradients are reduce-scattered back to the owners), and
the causal mask is built from global positions (key position <= query position). Rotary
embeddings use global positions too (``Transformer.forward(tokens, positions)``).

``attention="ring"`` instead passes K/V blocks around the cp ring with batched send/recv
(each transfer overlapping the block computed meanwhile) and merges the blocks with an
online softmax, so no rank ever holds the whole sequence's K/V; backward circulates the
blocks again together with their gradient accumulators, which end at their owners.

Everything else in the model is per token, so nothing else changes; each rank's loss is
the mean over its tokens (an equal share), and cp ranks act as data-parallel replicas for
the parameter gradients (DataParallel averages over dp x cp).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from chipset.errors import ConfigError
from chipset.interfaces import Collective, Group, P2POp

__all__ = ["ContextParallel", "apply_cp", "CP_ATTENTION"]

CP_ATTENTION = ("allgather", "ring")


class ContextParallel:
    """This rank's share of every sequence (``model.seq_layout``) and the attention over all of it."""

    def __init__(self, collective: Collective, group: Group, kernels, *, attention: str = "allgather"):
        if attention not in CP_ATTENTION:
            raise ConfigError(f"context-parallel attention {attention!r}: expected one of {', '.join(CP_ATTENTION)}")
        self.collective = collective
        self.group = group
        self.size = group.size
        self.rank = group.ranks.index(collective.rank())
        self._k = kernels
        self.attention = attention
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def _chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank

    def _check(self, s: int) -> int:
        if s % (2 * self.size):
            raise ConfigError(
                f"context parallel: sequence length ({s}) must be divisible by 2*cp ({2 * self.size}); "
                "change train.seq_len or parallel.cp"
            )
        return s // (2 * self.size)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` (batch, seq, ...): chunks ``i`` and ``2cp-1-i``."""
        c = self._check(t.shape[1])
        a, b = self._chunks(self.rank)
        return torch.cat([t[:, a * c:(a + 1) * c], t[:, b * c:(b + 1) * c]], dim=1)

    def positions_of(self, rank: int, s: int, device=None) -> torch.Tensor:
        c = self._check(s)
        a, b = self._chunks(rank)
        return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                          torch.arange(b * c, (b + 1) * c, device=device)])

    def positions(self, s: int, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens in a sequence of length ``s``."""
        return self.positions_of(self.rank, s, device)

    def _mask(self, s_local: int, device) -> torch.Tensor:
        key = (s_local, str(device))
        if key not in self._masks:
            s = s_local * self.size
            q = self.positions(s, device)
            k = torch.cat([self.positions_of(r, s, device) for r in range(self.size)])
            self._masks[key] = k.unsqueeze(0) <= q.unsqueeze(1)  # (s_local, s): True = attend
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of local queries over the whole sequence's keys/values ((b, h, s, d))."""
        from chipset.parallel.tensor import all_gather_along

        if self.attention == "ring":
            return _RingAttention.apply(q, k, v, self)

        k_all = all_gather_along(k, 2, self.collective, self.group)
        v_all = all_gather_along(v, 2, self.collective, self.group)
        mask = self._mask(q.shape[2], q.device)
        return self._k.scaled_dot_product_attention(q, k_all, v_all, mask=mask, causal=False)


# --- ring attention -------------------------------------------------------------------------


def _rotate(cp: ContextParallel, t: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Send ``t`` to the next cp rank and receive the previous rank's into a new buffer (async)."""
    nxt = cp.group.ranks[(cp.rank + 1) % cp.size]
    prv = cp.group.ranks[(cp.rank - 1) % cp.size]
    buf = torch.empty_like(t)
    handles = cp.collective.batch_p2p([P2POp("send", t, nxt, cp.group), P2POp("recv", buf, prv, cp.group)])
    return buf, handles


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Sum the gradient of repeated kv heads back onto each kv head."""
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring, block by block with an online softmax (float32 math)."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        s_local = q.shape[2]
        s = s_local * cp.size
        qpos = cp.positions(s, q.device)
        rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        qf = q.float()
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        m = torch.full(q.shape[:3], float("-inf"), device=q.device)
        l = torch.zeros(q.shape[:3], device=q.device)  # noqa: E741 - the softmax denominator, as in the papers
        kv = torch.stack([k, v]).contiguous()
        src = cp.rank
        for step in range(cp.size):
            pending = _rotate(cp, kv) if step < cp.size - 1 else None
            mask = cp.positions_of(src, s, q.device).unsqueeze(0) <= qpos.unsqueeze(1)
            if bool(mask.any()):
                kk, vv = _expand(kv[0].float(), rep), _expand(kv[1].float(), rep)
                sc = (qf @ kk.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
                new_m = torch.maximum(m, sc.amax(-1))
                safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
                p = torch.exp(sc - safe.unsqueeze(-1))
                alpha = torch.exp(m - safe)
                l = l * alpha + p.sum(-1)  # noqa: E741
                o = o * alpha.unsqueeze(-1) + p @ vv
                m = new_m
            if pending is not None:
                buf, handles = pending
                _wait(handles)
                kv = buf
            src = (src - 1) % cp.size
        o = o / l.unsqueeze(-1)  # every query attends at least itself: l > 0
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cp = cp
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        cp = ctx.cp
        s = q.shape[2] * cp.size
        qpos = cp.positions(s, q.device)
        rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        qf, dof = q.float(), do.float()
        delta = (dof * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        # Each block travels with its gradient accumulators: (k, v, dk, dv).
        blk = torch.stack([k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
                           torch.zeros_like(v, dtype=torch.float32)]).contiguous()
        src = cp.rank
        for step in range(cp.size):
            mask = cp.positions_of(src, s, q.device).unsqueeze(0) <= qpos.unsqueeze(1)
            if bool(mask.any()):
                kk, vv = _expand(blk[0], rep), _expand(blk[1], rep)
                sc = (qf @ kk.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
                p = torch.exp(sc - lse.unsqueeze(-1))
                blk[3] += _fold(p.transpose(-2, -1) @ dof, rep)
                ds = p * (dof @ vv.transpose(-2, -1) - delta)
                dq += ds @ kk * scale
                blk[2] += _fold(ds.transpose(-2, -1) @ qf * scale, rep)
            if step < cp.size - 1:
                buf, handles = _rotate(cp, blk)
            else:  # the last hop brings the finished gradients home
                buf, handles = _rotate(cp, blk[2:].contiguous())
            _wait(handles)
            blk = buf
            src = (src - 1) % cp.size
        return dq.to(q.dtype), blk[0].to(k.dtype), blk[1].to(v.dtype), None


def apply_cp(model: nn.Module, attention: list[nn.Module], *, cp: ContextParallel) -> nn.Module:
    """Make ``model`` train on this rank's share of each sequence, attending over all of it:
    ``model.seq_layout`` says which tokens this rank holds, and every module of ``attention``
    (the family's attention modules, ``ModelFamily.attention``) gets the cp core as ``attend``."""
    if cp.size == 1:
        return model
    model.seq_layout = cp
    for module in attention:
        module.attend = cp.attend
    return model
