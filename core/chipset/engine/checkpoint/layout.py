"""Map the engine's flat, sharded buffers onto logical, full-tensor names for DCP.

A checkpoint stores every parameter and optimizer tensor under its logical name and
its full (unsharded) shape: ``model.<fqn>``, ``optim.master.<fqn>``,
``optim.exp_avg.<fqn>``, ``optim.exp_avg_sq.<fqn>``. Each rank contributes the pieces it
owns as shards of that logical tensor (``ShardedTensor`` with explicit offsets), so
torch.distributed.checkpoint records where every piece sits and can read any other
split back: a different dp degree or ZeRO stage only changes which pieces a rank asks
for. A flat range of a row-major tensor is a union of at most ``2*ndim - 1`` boxes
(:func:`flat_range_boxes`); every box is a contiguous run of the flat buffer, so shards
are views, not copies.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["KINDS", "flat_range_boxes", "Piece", "engine_pieces", "sharded", "logical_shapes"]

KINDS = ("model", "optim.master", "optim.exp_avg", "optim.exp_avg_sq")
"""Logical tensor families; the key of a tensor is ``f"{kind}.{parameter fqn}"``."""


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[list[int], list[int]]]:
    """``[(offsets, sizes), ...]``: the boxes covering flat elements ``[start, end)`` of a row-major ``shape``."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [([start], [end - start])]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:
        return [([r0, *o], [1, *s]) for o, s in flat_range_boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [([r0, *o], [1, *s]) for o, s in flat_range_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(([r0] + [0] * (len(shape) - 1), [r1 - r0, *shape[1:]]))
    if c1:
        out += [([r1, *o], [1, *s]) for o, s in flat_range_boxes(shape[1:], 0, c1)]
    return out


@dataclass
class Piece:
    """The elements ``[start, end)`` of parameter ``name`` (flat, row-major) held by global rank ``rank``."""

    name: str
    shape: tuple[int, ...]
    rank: int
    start: int
    end: int
    tensor: torch.Tensor | None = None
    """This rank's flat view of the piece (None for other ranks' pieces)."""


def _intersect(lo: int, hi: int, off: int, n: int) -> tuple[int, int] | None:
    a, b = max(lo, off), min(hi, off + n)
    return (a - off, b - off) if b > a else None


def logical_shapes(engine) -> dict[str, tuple[int, ...]]:
    """Every parameter's fully-qualified name and logical (unsharded) shape."""
    return {n: tuple(s) for b in engine.buckets for n, s in zip(b.names, b.shapes, strict=True)}


def engine_pieces(engine, kind: str, *, for_load: bool) -> Iterator[tuple[str, list[Piece], bool]]:
    """For each parameter: ``(name, pieces of every rank, whole)``.

    Saving (``for_load=False``): every layout contributes rank ``i``'s owned slice
    ``[i*S, (i+1)*S)`` of each bucket, so each element is written once.
    Loading: the range this rank actually holds: the whole bucket for parameters at
    ZeRO < 3 and for optimizer state at ZeRO 0, else the owned slice. ``whole`` is True
    when this rank holds the whole parameter (a plain tensor target suffices).
    """
    e = engine
    ranks = e.group.ranks
    me = e.collective.rank()
    for b in e.buckets:
        held_whole = for_load and ((kind == "model" and e.zero < 3) or (kind != "model" and e.zero == 0))
        buf, buf_lo = _source(b, kind)
        for name, off, n, shape in zip(b.names, b.offsets, b.numels, b.shapes, strict=True):
            shape = tuple(shape)
            if held_whole:
                view = buf[off - buf_lo:off - buf_lo + n]
                yield name, [Piece(name, shape, me, 0, n, view)], True
                continue
            pieces = []
            for i, rank in enumerate(ranks):
                hit = _intersect(i * b.shard, (i + 1) * b.shard, off, n)
                if hit is None:
                    continue
                p = Piece(name, shape, rank, hit[0], hit[1])
                if rank == me:
                    a = off + hit[0] - buf_lo
                    p.tensor = buf[a:a + hit[1] - hit[0]]
                pieces.append(p)
            yield name, pieces, False


def _source(b, kind: str) -> tuple[torch.Tensor, int]:
    """The buffer holding ``kind`` for bucket ``b`` and the bucket offset of its first element."""
    e = b.engine
    if kind == "model":
        if b.full is not None:
            return b.full, 0
        return b.param_shard, b.lo
    t = {"optim.master": b.master, "optim.exp_avg": b.exp_avg, "optim.exp_avg_sq": b.exp_avg_sq}[kind]
    return t, 0 if e.zero == 0 else b.lo


def sharded(pieces: list[Piece], dtype: torch.dtype):
    """``(ShardedTensor, [(piece, host flat)])``: the logical full tensor whose local shards are
    this rank's pieces, held in fresh host (CPU) tensors, so what is written and read is
    device-neutral. Saving copies the pieces in first; loading copies them out after."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    shape = pieces[0].shape
    mds, local, hosts = [], [], []
    for p in pieces:
        flat = None
        if p.tensor is not None:
            flat = torch.empty(p.end - p.start, dtype=dtype, device="cpu")
            hosts.append((p, flat))
        for offsets, sizes in flat_range_boxes(shape, p.start, p.end):
            md = ShardMetadata(offsets, sizes, f"rank:{p.rank}/cpu")
            mds.append(md)
            if flat is not None:
                first = sum(o * s for o, s in zip(offsets, _strides(shape), strict=True)) - p.start
                local.append(Shard(flat[first:first + math.prod(sizes)].view(sizes), md))
    meta = ShardedTensorMetadata(mds, torch.Size(shape), TensorProperties(dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
    return st, hosts


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return list(reversed(out))
