"""Context parallelism: each sequence is split across cp ranks; attention sees all of it.

Load-balanced layout: the sequence is cut into ``2*cp`` equal chunks and cp rank ``i`` holds
chunks ``i`` and ``2*cp-1-i`` (one early, one late), so under the causal mask every rank
has the same number of (query, key) pairs to attend.

Attention: each rank computes queries for its own tokens; keys and values are all-gathered
over the cp group (backward: their gradients are reduce-scattered back to the owners), and
the causal mask is built from global positions (key position <= query position). Rotary
embeddings use global positions too (``Transformer.forward(tokens, positions)``).

``attention="ring"`` instead passes K/V blocks around the cp ring and merges one fused
attention block per step by log-sum-exp (parallel/ring.py), so no rank ever holds the whole
sequence's K/V nor a block's score matrix. ``attention="ulysses"`` all-to-alls q, k, v from
a sequence split to a head split, attends over the whole sequence on its heads and
all-to-alls back (parallel/ulysses.py): heads / cp must be whole. ``attention="hybrid"``
runs Ulysses inside groups of ``ulysses`` adjacent cp ranks and the ring across them
(parallel/hybrid.py), on the two sub-groups ``subgroups`` (parallel/hybrid.py ``hybrid_groups``).

Document masks: ``attend(q, k, v, docs)`` with ``docs`` the document id of every token of
the whole sequences (``(b, s)``) keeps each query within its own document, in every mode.

Everything else in the model is per token, so nothing else changes; each rank's loss is
the mean over its tokens (an equal share), and cp ranks act as data-parallel replicas for
the parameter gradients (DataParallel averages over dp x cp).
"""

from __future__ import annotations

import torch
from torch import nn

from chipset.errors import ConfigError
from chipset.interfaces import Collective, Group
from chipset.layers.documents import document_mask

__all__ = ["ContextParallel", "apply_cp", "CP_ATTENTION"]

CP_ATTENTION = ("allgather", "ring", "ulysses", "hybrid")


class ContextParallel:
    """This rank's share of every sequence (``model.seq_layout``) and the attention over all of it."""

    def __init__(self, collective: Collective, group: Group, kernels, *, attention: str = "allgather",
                 subgroups: tuple[Group, Group] | None = None):
        if attention not in CP_ATTENTION:
            raise ConfigError(f"context-parallel attention {attention!r}: expected one of {', '.join(CP_ATTENTION)}")
        if (attention == "hybrid") != (subgroups is not None):
            raise ConfigError("context-parallel attention 'hybrid' needs its (Ulysses, ring) sub-groups "
                              "(parallel/hybrid.py hybrid_groups), and only it takes them")
        self.collective = collective
        self.group = group
        self.size = group.size
        self.rank = group.ranks.index(collective.rank())
        self.kernels = kernels
        self.attention = attention
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        if subgroups is not None:  # the inner Ulysses axis and the outer ring (parallel/hybrid.py)
            self.heads = ContextParallel(collective, subgroups[0], kernels, attention="ulysses")
            self.ring = ContextParallel(collective, subgroups[1], kernels, attention="ring")

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

    def rank_major_positions(self, s: int, device=None) -> torch.Tensor:
        """Global positions of every rank's tokens, rank after rank (what an all-gather yields)."""
        return torch.cat([self.positions_of(r, s, device) for r in range(self.size)])

    def _mask(self, s_local: int, device) -> torch.Tensor:
        key = (s_local, str(device))
        if key not in self._masks:
            s = s_local * self.size
            q = self.positions(s, device)
            k = torch.cat([self.positions_of(r, s, device) for r in range(self.size)])
            self._masks[key] = k.unsqueeze(0) <= q.unsqueeze(1)  # (s_local, s): True = attend
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Causal attention of local queries over the whole sequence's keys/values ((b, h, s, d));
        ``docs``: document ids of the whole sequences (b, s), or None for one document each."""
        from chipset.parallel.hybrid import hybrid_attention
        from chipset.parallel.ring import ring_attention
        from chipset.parallel.tensor import all_gather_along
        from chipset.parallel.ulysses import ulysses_attention

        if self.attention == "ring":
            return ring_attention(q, k, v, self, docs)
        if self.attention == "ulysses":
            return ulysses_attention(q, k, v, self, docs)
        if self.attention == "hybrid":
            return hybrid_attention(q, k, v, self, docs)
        k_all = all_gather_along(k, 2, self.collective, self.group)
        v_all = all_gather_along(v, 2, self.collective, self.group)
        if docs is None:
            mask = self._mask(q.shape[2], q.device)
        else:
            s = q.shape[2] * self.size
            qpos, kpos = self.positions(s, q.device), self.rank_major_positions(s, q.device)
            mask = document_mask(docs[:, qpos], docs[:, kpos], qpos, kpos)
        return self.kernels.scaled_dot_product_attention(q, k_all, v_all, mask=mask, causal=False)


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
