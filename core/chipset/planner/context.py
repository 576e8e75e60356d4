"""Context layouts for one sequence length: which cp degree, attention and memory savers.

``chipset plan --context`` asks: for this model, cluster and sequence length, how should a
sequence be split and what should be traded for memory? Each candidate is a cp degree (the
rest of the devices data-parallel, tp = pp = 1), a cp attention (ring: K/V passed round the
ring; ulysses: all-to-all to a head split, only where heads divide by cp; hybrid: Ulysses over
``u`` adjacent ranks and the ring across, for every ``u`` dividing cp and the heads), a recompute mode,
ZeRO 1 or 3, and the long-context savers (a chunked loss of :data:`LOSS_CHUNK` tokens;
activation offload to host). Every candidate is costed by the same memory and time model as
the search (planner/memory.py, planner/time.py); the recommendation is the fastest that fits,
ties going to the fewest savers.
"""

from __future__ import annotations

from chipset.errors import UsageError
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import memory_per_device
from chipset.planner.model import ModelSpec
from chipset.planner.time import Prediction, evaluate

__all__ = ["context_layouts", "LOSS_CHUNK", "SAVERS"]

LOSS_CHUNK = 4096
"""Tokens per chunk of the head and loss the candidates with a chunked loss use."""

SAVERS = ((False, 0), (False, LOSS_CHUNK), (True, LOSS_CHUNK))
"""(offload activations, loss chunk) combinations tried, cheapest first."""


def _attentions(m: ModelSpec, cp: int) -> list[tuple[str, int]]:
    """(cp attention, Ulysses degree of a hybrid or 0) candidates for ``cp``."""
    if cp == 1:
        return [("ring", 0)]  # no split: the attention mode does not matter
    out = [("ring", 0)] + ([("ulysses", 0)] if m.heads % cp == 0 else [])
    return out + [("hybrid", u) for u in range(2, cp // 2 + 1) if cp % u == 0 and m.heads % u == 0]


def context_layouts(m: ModelSpec, train: TrainSpec, cl: Cluster, seq_len: int,
                    assumptions: Assumptions | None = None) -> list[Prediction]:
    """Every candidate (module doc), fitting ones first, each group fastest first."""
    a = assumptions or Assumptions()
    n = cl.world_size
    out = []
    for cp in (c for c in range(1, n + 1) if n % c == 0 and seq_len % (2 * c if c > 1 else 1) == 0):
        dp = n // cp
        if train.global_batch % dp:
            continue
        for attention, ulysses in _attentions(m, cp):
            for rank, (offload, chunk) in enumerate(SAVERS):
                for recompute in ("none", "full"):
                    for zero in (1, 3) if n > 1 else (0,):
                        lay = Layout(dp=dp, cp=cp, zero=zero, micro_batch=1, recompute=recompute,
                                     cp_attention=attention, cp_ulysses=ulysses, offload_activations=offload,
                                     loss_chunk=min(chunk, seq_len)).check()
                        mem = memory_per_device(m, lay, train, seq_len)
                        p = evaluate(m, lay, train, cl, a, seq_len, memory=mem)
                        out.append((not p.fits, p.step_time_s, rank, p))
    if not out:
        raise UsageError(f"no context layout for sequence length {seq_len} on {n} devices: the global batch "
                         f"({train.global_batch}) must divide by dp and the sequence by 2*cp")
    out.sort(key=lambda x: x[:3])
    return [p for *_, p in out]
