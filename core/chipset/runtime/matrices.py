"""Whole weight matrices for optimizers that update a matrix as one (Muon), under ZeRO and tp.

The engine hands an optimizer the flat slice of a bucket this rank owns. Muon orthogonalises
each hidden weight matrix's update as a whole, so it needs the whole matrix of the update, not
a slice: :class:`BucketMatrices` knows which parameters of a bucket are hidden matrices
(:func:`hidden_matrix_names`) and which of them overlap this rank's owned slice, and assembles
their full values from per-element owned values:

* ZeRO 0: the owned slice is the whole bucket; nothing is gathered.
* ZeRO 1-3: one all-gather of the owned values over the bucket's sharding group per step
  (float32, the bucket's padded size), then every rank orthogonalises only the matrices that
  overlap its slice (a matrix split across two ranks is computed by both, identically).
* tp: a tp-sharded matrix is all-gathered along its split dimension over the tp group, so the
  orthogonalisation sees the logical matrix; each rank keeps its own slice of the result. tp
  peers hold the same bucket layout and owned range, so they gather the same matrices in the
  same order.

The result equals the single-process update up to the matmul's rounding (the same logical
matrix enters the same float32 iteration), which is what the parity tests check.
"""

from __future__ import annotations

import torch
from torch import nn

from chipset.parallel.tensor import VocabParallelEmbedding, gather_along, tp_shard

__all__ = ["BucketMatrices", "hidden_matrix_names"]


def hidden_matrix_names(model: nn.Module) -> set[str]:
    """Names of the hidden weight matrices: 2-D parameters that are neither an embedding's
    (``nn.Embedding``, the vocab-parallel one) nor the output head's (``*lm_head.weight``).
    Muon's authors keep embeddings, the head, norms, biases (and convolutions here) on AdamW."""
    embed = {id(p) for m in model.modules() if isinstance(m, nn.Embedding | VocabParallelEmbedding)
             for p in m.parameters(recurse=False)}
    return {n for n, p in model.named_parameters()
            if p.ndim == 2 and id(p) not in embed and not n.endswith("lm_head.weight")}


class BucketMatrices:
    """The hidden matrices of one bucket that overlap this rank's owned slice.

    ``entries``: ``(name, a, b, off, shape, param)`` with ``[a, b)`` the matrix's elements in
    owned coordinates and ``off`` its first element's index within the parameter; ``elementwise``:
    the complementary owned ranges (everything else, padding included)."""

    def __init__(self, bucket, matrices: set[str]):
        e = bucket.engine
        self.bucket = bucket
        lo, hi = (0, bucket.padded) if e.zero == 0 else (bucket.lo, bucket.hi)
        self.entries = []
        for name, p, off, n, shape in zip(bucket.names, bucket.params, bucket.offsets, bucket.numels,
                                          bucket.shapes, strict=True):
            a, b = max(lo, off), min(hi, off + n)
            if name in matrices and a < b:
                self.entries.append((name, a - lo, b - lo, a - off, tuple(shape), p))
        self.gathers = any(name in matrices for name in bucket.names)  # the same on every rank of the group
        self.elementwise, cur = [], 0
        for _, a, b, *_ in self.entries:
            if cur < a:
                self.elementwise.append((cur, a))
            cur = b
        if cur < hi - lo:
            self.elementwise.append((cur, hi - lo))

    def full(self, owned: torch.Tensor):
        """Yield ``(a, b, off, full_matrix, put)`` per matrix: its whole (dp- and tp-gathered)
        value of the per-element ``owned``; ``put(full_update)`` returns this rank's ``[a, b)``
        of a same-shaped full result."""
        if not self.gathers:
            return
        bk, e = self.bucket, self.bucket.engine
        if e.zero == 0 or bk.n == 1:
            flat, base = owned, (0 if e.zero == 0 else bk.lo)
        else:
            flat = torch.empty(bk.padded, dtype=owned.dtype, device=owned.device)
            e.collective.all_gather(flat, owned.contiguous(), group=bk.group)
            base = 0
        for name, a, b, off, shape, p in self.entries:
            start = bk.offsets[bk.names.index(name)] - base
            local = flat[start:start + p.numel()].view(shape)
            shard = tp_shard(p) if e.tp_group is not None else None
            if shard is None:
                yield a, b, off, local, lambda full, a=a, b=b, off=off: full.reshape(-1)[off:off + b - a]
                continue
            whole = gather_along(local, shard.dim, e.collective, e.tp_group)
            k = shape[shard.dim]

            def put(full, a=a, b=b, off=off, dim=shard.dim, k=k, r=shard.rank):
                return full.narrow(dim, r * k, k).reshape(-1)[off:off + b - a]

            yield a, b, off, whole, put
