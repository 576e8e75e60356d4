"""How a pipeline splits the blocks: blocks per rank, per model chunk, and the interleaving depths searched.

When p divides l every rank holds l/p blocks (l/(pv) per chunk). When it does not, the ranks
hold ⌊l/p⌋ or ⌈l/p⌉ blocks: the l mod p heavier ranks sit in the middle and the lighter ones
first and last, which also hold the embedding and the head, as Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` and
Llama 3 405B's 126 blocks on 16 stages do (Dubey et al. 2024, Sec. 3.3.2: one block fewer on
the first and the last stage). Further lighter ranks come right after the first (the early
ranks hold the most micro-batches in flight); a single lighter rank is the last (the head's
GEMM and loss cost time every micro-batch, the embedding lookup almost none).

With v chunks per rank (interleaved 1F1B) a rank's blocks are split over its chunks by the
same rule; virtual stage ``j*p + r`` is chunk j of rank r. When only the first and the last rank
are lighter and v = ⌈l/p⌉ (one block per chunk), their edge chunks hold no block: the first
virtual stage only the embedding, the last only the head, as Llama 3 405B ran (Dubey et al.
2024, Sec. 3.3.2). ``chipset train`` runs any such split through ``parallel.pipeline_split``
(:func:`pipeline_split` writes it).
"""

from __future__ import annotations

import math

__all__ = ["stage_block_counts", "virtual_stage_blocks", "pipeline_split", "interleave_depths", "even_split",
           "largest_chunk", "MAX_INTERLEAVE"]

MAX_INTERLEAVE = 8
"""The deepest interleaving (chunks per rank) the search and the published table try."""


def even_split(layers: int, pp: int, v: int = 1) -> bool:
    """True when every rank holds l/p blocks and every chunk l/(pv): the layouts whose predictions
    the uneven-split model leaves exactly as they were."""
    return layers % (pp * v) == 0


def stage_block_counts(layers: int, pp: int) -> tuple[int, ...]:
    """Blocks on each pipeline rank, first to last (module doc); ValueError when pp > layers."""
    if pp < 1 or layers < pp:
        raise ValueError(f"cannot split {layers} blocks over {pp} pipeline stages: each stage needs a block")
    base, extra = divmod(layers, pp)
    if extra == 0:
        return (base,) * pp
    counts = [base + 1] * pp
    counts[-1] = base
    for i in range(pp - extra - 1):  # the other lighter ranks: the first, then its neighbours
        counts[i] = base
    return tuple(counts)


def virtual_stage_blocks(layers: int, pp: int, v: int = 1) -> tuple[int, ...]:
    """Blocks per virtual stage (model chunk) in pipeline order, p*v entries: each rank's blocks
    split over its v chunks by :func:`stage_block_counts`'s rule (a chunk may get 0 blocks when a
    rank holds fewer than v)."""
    per_rank = stage_block_counts(layers, pp)
    chunks = [_chunks(c, v, first=r == 0) for r, c in enumerate(per_rank)]
    return tuple(chunks[r][j] for j in range(v) for r in range(pp))


def _chunks(blocks: int, v: int, first: bool) -> tuple[int, ...]:
    """A rank's blocks over its v chunks; the first rank's lighter chunks come first (its chunk 0
    holds the embedding), every other rank's last (the last rank's final chunk holds the head)."""
    if blocks >= v:
        counts = stage_block_counts(blocks, v)
    else:  # empty chunks, at the pipeline's ends
        counts = (1,) * blocks + (0,) * (v - blocks)
    return counts[::-1] if first else counts


def largest_chunk(blocks: int, v: int) -> int:
    """Blocks in the largest of v chunks of a rank holding ``blocks``."""
    return math.ceil(blocks / v)


def pipeline_split(layers: int, pp: int, v: int = 1) -> str:
    """``parallel.pipeline_split`` for ``chipset train`` (blocks per virtual stage), or "" when the
    split is even (the engine's default then balances by parameter count)."""
    if pp <= 1 or even_split(layers, pp, v):
        return ""
    return ",".join(map(str, virtual_stage_blocks(layers, pp, v)))


def interleave_depths(layers: int, pp: int, limit: int = MAX_INTERLEAVE) -> list[int]:
    """Chunks per rank (v >= 2) worth trying: v divides the blocks of the heaviest rank (⌈l/p⌉) and
    every chunk of the lighter ranks still holds a block (v <= ⌊l/p⌋); when p divides l, the
    divisors of l/p (Megatron-LM's condition). Also v = ⌈l/p⌉ when only the first and the last
    rank are lighter (their edge chunks then hold just the embedding and the head: module doc)."""
    if pp <= 1 or layers < pp:
        return []
    heavy, light = -(-layers // pp), layers // pp
    out = [v for v in range(2, min(light, limit) + 1) if heavy % v == 0]
    if layers % pp == pp - 2 and 2 <= heavy <= limit and heavy not in out:
        out.append(heavy)
    return out
