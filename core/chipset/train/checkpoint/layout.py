"""Map the engine's flat, sharded buffers onto logical, full-tensor names for DCP.

A checkpoint stores every parameter and optimizer tensor under its logical name and
its full (unsharded) shape: ``model.<fqn>``, ``optim.master.<fqn>``,
and one family per optimizer state tensor (AdamW: ``optim.exp_avg.<fqn>``,
``optim.exp_avg_sq.<fqn>``; :func:`kinds`). Each rank contributes the pieces it
owns as chunks of that logical tensor at explicit offsets (:func:`write_planner`), so
torch.distributed.checkpoint records where every piece sits and can read any other
split back: a different dp degree or ZeRO stage only changes which pieces a rank asks
for. A flat range of a row-major tensor is a union of at most ``2*ndim - 1`` boxes
(:func:`flat_range_boxes`); every box is a contiguous run of the flat buffer, so the
boxes of a piece are views of its one host copy (:func:`host_boxes`).

Where a piece sits in the logical tensor, per layout dimension:

* dp / cp / ZeRO: the owned slice of the bucket (index in the bucket's sharding group:
  dp, dp x cp, or for experts edp); cp ranks are replicas, so each piece is written once.
* tp: shifted along the split dimension (``parallel.tensor.TPShard``) by the tp slice offset (vocabulary padding dropped);
  tp-replicated parameters are written by tp index 0 only.
* ep: expert tensors hold rows ``[ep_idx * E_local, ...)`` of the logical ``[E, ...]``.
* pp: each stage writes the parameters it holds, under the single-process names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from chipset.parallel.tensor import tp_shard

__all__ = ["KINDS", "kinds", "Box", "Piece", "engine_pieces", "flat_range_boxes", "logical_shapes", "host_boxes", "read_planner", "write_planner"]

KINDS = ("model", "optim.master")
"""Logical tensor families every engine has; the key of a tensor is ``f"{kind}.{parameter fqn}"``."""


def kinds(engine) -> tuple[str, ...]:
    """Every logical tensor family of ``engine``: the parameters, the float32 masters (without
    masters: the parameters again, as float32), one family per state tensor its optimizer declares
    (AdamW: ``optim.exp_avg``, ``optim.exp_avg_sq``) and the engine keeps beside them (Kahan's
    ``optim.compensation``: runtime/bf16_update.py) and, in an islands job, the outer state
    (``outer.global``, ``outer.momentum``, ``outer.residual``: train/islands/outer.py), shaped and
    sharded like the masters."""
    outer = next((tuple(b.outer) for b in engine.buckets if getattr(b, "outer", None)), ())
    states = next((tuple(b.state) for b in engine.buckets if not b.frozen), engine.optimizer.state_names)
    return (*KINDS, *(f"optim.{name}" for name in states), *(f"outer.{n}" for n in outer))


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
class Box:
    """One box of a logical tensor held by global rank ``rank`` (a DCP chunk)."""

    offsets: list[int]
    sizes: list[int]
    rank: int
    local_first: int = 0
    """Flat index, within the rank's piece, of the box's first element."""
    local_sizes: list[int] | None = None
    clip: tuple[int, int] | None = None
    """(dim, length): the local box is longer along dim (tp vocabulary padding, never stored)."""

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This box inside ``flat`` (the rank's piece, flat)."""
        t = flat[self.local_first:self.local_first + math.prod(self.local_sizes)].view(self.local_sizes)
        return t.narrow(self.clip[0], 0, self.clip[1]) if self.clip else t


@dataclass
class Piece:
    """The elements ``[start, end)`` of parameter ``name`` (flat, row-major, local shape) on global rank ``rank``."""

    name: str
    shape: tuple[int, ...]
    """Logical (unsharded) shape."""
    rank: int
    start: int
    end: int
    boxes: list[Box]
    tensor: torch.Tensor | None = None
    """This rank's flat view of the piece in the engine's buffer."""


def _intersect(lo: int, hi: int, off: int, n: int) -> tuple[int, int] | None:
    a, b = max(lo, off), min(hi, off + n)
    return (a - off, b - off) if b > a else None


def _splits(p, expert_ep: int = 1, ep_index: int = 0, tp_index: int = 0) -> list[tuple[int, int, int]]:
    """How local tensor ``p`` is cut from its logical tensor: ``[(dim, index, logical size), ...]``.

    Slice ``index`` along ``dim`` starts at ``index * local size``. tp-sharded parameters
    carry a ``TPShard`` (the logical size, vocabulary padding excluded); ep-sharded
    experts (``expert_ep > 1``) are one block of rows of ``[E, ...]``.
    """
    out = []
    shard = tp_shard(p)
    if shard is not None:
        out.append((shard.dim, tp_index, shard.size))
    if expert_ep > 1:
        out.append((0, ep_index, p.shape[0] * expert_ep))
    return out


def _logical_shape(shape, splits) -> tuple[int, ...]:
    shape = list(shape)
    for dim, _, size in splits:
        shape[dim] = size
    return tuple(shape)


def _expert_ep(engine, bucket) -> int:
    return engine.dims.ep if bucket.expert else 1


def logical_shapes(engine) -> dict[str, tuple[int, ...]]:
    """Every parameter's fully-qualified name and logical (single-process) shape.

    A pipeline engine holds only its stages, so it reports the whole model's shapes
    (``model_shapes``, recorded before the split): every stage checks the same set.
    """
    whole = getattr(engine, "model_shapes", None)
    if whole is not None:
        return {n: tuple(s) for n, s in whole.items()}
    return {n: _logical_shape(s, _splits(p, _expert_ep(engine, b))) for b in engine.buckets
            for n, s, p in zip(b.names, b.shapes, b.params, strict=True)}


def _boxes(local_shape: tuple[int, ...], a: int, b: int, splits, rank: int) -> list[Box]:
    """Logical boxes of local flat elements ``[a, b)`` (``splits``: see :func:`_splits`)."""
    out = []
    strides = _strides(local_shape)
    for lo_off, lo_sz in flat_range_boxes(local_shape, a, b):
        off, sz, clip = list(lo_off), list(lo_sz), None
        for dim, index, size in splits:
            o0 = lo_off[dim] + index * local_shape[dim]
            o1 = min(o0 + lo_sz[dim], size)
            if o1 <= o0:
                break  # entirely vocabulary padding
            off[dim], sz[dim] = o0, o1 - o0
            if o1 - o0 != lo_sz[dim]:
                clip = (dim, o1 - o0)
        else:
            first = sum(o * st for o, st in zip(lo_off, strides, strict=True)) - a
            out.append(Box(off, sz, rank, first, list(lo_sz), clip))
    return out


def _index_in(dims, dim: str) -> dict[int, int]:
    """Global rank -> its index within its group along ``dim`` (no communication)."""
    return {r: i for ranks in dims.group_ranks(dim) for i, r in enumerate(ranks)}


def engine_pieces(engine, kind: str, *, for_load: bool) -> Iterator[tuple[str, tuple[int, ...], list[Piece]]]:
    """For each parameter this rank holds: ``(name, logical shape, pieces)``.

    Saving (``for_load=False``): this rank's share. Every rank of a pipeline stage holds the
    same buckets (other stages write their own parameters); rank r contributes its owned
    slice ``[i*S, (i+1)*S)`` of each bucket (i: its index in the bucket's sharding group),
    cut at parameter boundaries and placed at its tp and ep offsets; parameters replicated
    over tp are written by tp index 0 only, so every logical element is written exactly once.
    Loading: what this rank actually holds: the whole bucket for parameters at ZeRO < 3 and
    for optimizer state at ZeRO 0, else the owned slice.
    """
    e = engine
    me = e.collective.rank()
    dims = e.dims
    tp_j = dims.coords(me)["tp"]
    replica = _index_in(dims, "dp_cp" if dims.cp_enabled else "dp")
    edp, ep = (_index_in(dims, "edp"), _index_in(dims, "ep")) if dims.ep_enabled else ({}, {})
    for bkt in e.buckets:
        if bkt.frozen and kind != "model":
            continue  # frozen parameters have no master weights or optimizer state
        i = (edp if bkt.expert else replica)[me]
        if i * bkt.shard != bkt.lo:  # the rank arithmetic must match the engine's groups
            raise RuntimeError(f"checkpoint layout: rank {me} owns bucket {bkt.index} from {bkt.lo}, expected "
                               f"{i * bkt.shard}; the group order changed without layout.py")
        held_whole = for_load and ((kind == "model" and e.zero < 3) or (kind != "model" and e.zero == 0))
        buf, buf_lo = _source(bkt, kind)
        expert_ep = _expert_ep(e, bkt)
        for name, off, n, shape, p in zip(bkt.names, bkt.offsets, bkt.numels, bkt.shapes, bkt.params, strict=True):
            shape = tuple(shape)
            logical = _logical_shape(shape, _splits(p, expert_ep))
            pieces = []
            hit = (0, n) if held_whole else _intersect(i * bkt.shard, (i + 1) * bkt.shard, off, n)
            writes = for_load or tp_shard(p) is not None or tp_j == 0  # a tp-replicated parameter: tp index 0
            if hit is not None and writes:
                boxes = _boxes(shape, hit[0], hit[1], _splits(p, expert_ep, ep.get(me, 0), tp_j), me)
                if boxes:
                    a = off + hit[0] - buf_lo
                    pieces.append(Piece(name, logical, me, hit[0], hit[1], boxes, buf[a:a + hit[1] - hit[0]]))
            yield name, logical, pieces


def _source(b, kind: str) -> tuple[torch.Tensor, int]:
    """The buffer holding ``kind`` for bucket ``b`` and the bucket offset of its first element."""
    e = b.engine
    if kind == "model":
        if b.full is not None:
            return b.full, 0
        return b.param_shard, b.lo
    if kind.startswith("outer."):
        t = b.outer[kind.removeprefix("outer.")]
    else:
        t = b.master if kind == "optim.master" else b.state[kind.removeprefix("optim.")]
    if not isinstance(t, torch.Tensor):  # int8 state (runtime/int8_state.py): its float32 values
        t = t.staged()
    return t, 0 if e.zero == 0 else b.lo


def host_boxes(pieces: list[Piece], dtype: torch.dtype) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """This rank's boxes of one logical tensor: ``[(offsets, sizes, host tensor), ...]``.

    Each piece is copied once to a fresh host (CPU) tensor in ``dtype``, so what is written is
    device-neutral and an asynchronous save never sees the engine's later updates; a box is a
    view of that copy (a copy only where vocabulary padding is clipped off).
    """
    out = []
    for p in pieces:
        flat = p.tensor.detach().reshape(-1).to("cpu", dtype, copy=True)
        out += [(list(b.offsets), list(b.sizes), b.view(flat).contiguous()) for b in p.boxes]
    return out


def write_planner(tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[list[int], list[int], torch.Tensor]]]]):
    """A DCP save planner that writes this rank's boxes of logical tensors as chunks of them.

    ``tensors``: ``{key: (logical shape, dtype, [(offsets, sizes, host tensor), ...])}`` (from
    :func:`host_boxes`); the state dict given to ``dcp.save`` holds only whole plain tensors
    (the RNG states), saved the default way.

    Why a planner and not DTensor: DCP records a tensor as its global size plus chunks
    (offsets, sizes), and any set of chunks that tiles it is a valid checkpoint. A DTensor
    must be one regular placement over a device mesh, but a ZeRO flat slice of a bucket cuts
    across parameter boundaries: a rank holds any number of irregular boxes of a tensor (up to
    ``2*ndim - 1`` per piece), or none. The planner emits exactly those boxes as ``SHARD``
    write items, which is what DCP itself writes for sharded tensors, so ``.metadata`` is the
    standard ``TensorStorageMetadata``/``ChunkStorageMetadata`` and loads with any reader.
    The coordinator's global plan is the union of every rank's items: a tensor this rank holds
    no box of is recorded from the ranks that do. Replicas never offer a box twice
    (:func:`engine_pieces`); DCP's dedup would keep one item per key and offsets anyway, and its
    validation refuses overlapping chunks or, with several ranks, chunks that leave a gap.
    """
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    data, items = {}, []
    for fqn, (shape, dtype, boxes) in tensors.items():
        for offsets, sizes, t in boxes:
            off = torch.Size(offsets)
            data[(fqn, off)] = t
            items.append(WriteItem(
                index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(sizes)),
                                            properties=TensorProperties(dtype=dtype), size=torch.Size(shape))))

    class _Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        def resolve_data(self, write_item):
            t = data.get((write_item.index.fqn, write_item.index.offset))
            return t if t is not None else super().resolve_data(write_item)

    return _Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def read_planner(chunks: dict[str, list[tuple[list[int], list[int], torch.Tensor]]]):
    """A DCP load planner that reads the given boxes of logical tensors into the given tensors.

    Boxes may overlap across ranks (replicas each read what they hold), and nothing is ever
    unpickled: byte items are refused.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _Planner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items, self._targets = [], {}
            for fqn, boxes in chunks.items():
                md = self.metadata.state_dict_metadata[fqn]
                local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in boxes]
                items += create_read_items_for_chunk_list(fqn, md, local)
                for o, _, t in boxes:
                    self._targets[(fqn, tuple(o))] = t
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            t = self._targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                t = t.narrow(dim, o, n)
            return t

        def load_bytes(self, read_item, value) -> None:
            raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; chipset never "
                             "unpickles checkpoint data")

    return _Planner(flatten_state_dict=False, allow_partial_load=True)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return list(reversed(out))
