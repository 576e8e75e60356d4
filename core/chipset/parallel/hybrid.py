"""Hybrid context parallelism: Ulysses inside groups of ``u`` cp ranks, ring across them.

The cp group of ``cp = u * r`` ranks is cut into ``r`` Ulysses groups of ``u`` adjacent cp
ranks (cp rank ``i`` is member ``i % u`` of Ulysses group ``i // u``: adjacent ranks, the
ones that share a node) and ``u`` ring groups (the ranks with the same ``i % u``). One
all-to-all inside the Ulysses group trades the sequence split for a head split, as in
parallel/ulysses.py: each rank then holds ``heads / u`` heads of its Ulysses group's tokens.
Those tokens are chunks ``g*u .. g*u+u-1`` and their mirrors of the load-balanced layout
(parallel/context.py), two contiguous runs: exactly the two chunks that a cp of ``r`` ranks
gives ring rank ``g``. Sorted by position, they are the ring's load-balanced layout, so the
ring (parallel/ring.py) runs unchanged over the ``r`` ranks of the ring group on those
heads, and a second all-to-all brings every rank its own tokens of all heads back.

Traffic per block: Ulysses' four all-to-alls of ``1/u`` of q, k, v, out over the inner
group, and ``r - 1`` ring hops of the (head-split) K/V over the outer group, overlapped
with the steps. Heads per tp rank must divide by ``u``; kv heads are repeated up to
``lcm(kv heads, u)`` as in Ulysses.
"""

from __future__ import annotations

import torch

from chipset.interfaces import Collective, Group
from chipset.parallel.ring import ring_attention
from chipset.parallel.ulysses import _ToSeq, split_heads

__all__ = ["hybrid_groups", "hybrid_attention"]


def hybrid_groups(collective: Collective, cp_groups: list[list[int]], ulysses: int) -> tuple[Group, Group]:
    """(this rank's Ulysses group, its ring group), created for every cp group of ``cp_groups``
    (global ranks in cp order): ``new_group`` is collective over the world."""
    me = collective.rank()
    mine: dict[str, Group] = {}
    for ranks in cp_groups:
        inner = [ranks[i:i + ulysses] for i in range(0, len(ranks), ulysses)]
        outer = [ranks[j::ulysses] for j in range(ulysses)]
        for kind, groups in (("ulysses", inner), ("ring", outer)):
            for g in groups:
                group = collective.new_group(g, name=f"cp_{kind}{g}")
                if me in g:
                    mine[kind] = group
    return mine["ulysses"], mine["ring"]


def hybrid_attention(q, k, v, cp, docs=None):
    """Causal attention of this rank's tokens (all heads): Ulysses over ``cp.heads``, ring over ``cp.ring``."""
    heads, ring = cp.heads, cp.ring
    u = heads.size
    qh, kh, vh = split_heads(q, k, v, heads, "hybrid", "cp_ulysses", "choose another parallel.cp_ulysses")
    s = q.shape[2] * cp.size
    group = ring.rank * u  # the first cp rank of this Ulysses group
    held = torch.cat([cp.positions_of(group + j, s, q.device) for j in range(u)])  # rank-major -> global position
    order = torch.argsort(held)  # ascending: the ring's layout of r ranks
    back = torch.argsort(order)
    qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
    out = ring_attention(qh, kh, vh, ring, docs)
    return _ToSeq.apply(out.index_select(2, back), heads)
