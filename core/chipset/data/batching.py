"""The batch contract every token source shares (datasets.py's module docstring explains it).

``batch(data, step, dp_rank, dp, micro, micro_batches, device)``: step ``s`` is sequences
``s*G .. s*G+G-1`` of ``data.sequence`` (G = ``data.global_batch``); dp rank ``r`` takes the
contiguous ``G/dp`` block starting at ``r*G/dp`` and micro-batch ``m`` its ``m``-th part. A
source only defines ``sequence(i)`` (``seq_len + 1`` token ids) and ``global_batch`` and uses
``batch = batching.batch`` as its method; one that also defines ``token_ids(i)`` (the same ids as
a list of ints) has each micro-batch made as one tensor from those lists.
"""

from __future__ import annotations

import torch


def batch(data, step: int, dp_rank: int = 0, dp: int = 1, micro: int = 0, micro_batches: int = 1,
          device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of this rank's micro-batch ``micro`` of ``step``."""
    per_rank = data.global_batch // dp
    mb = per_rank // micro_batches
    first = step * data.global_batch + dp_rank * per_rank + micro * mb
    token_ids = getattr(data, "token_ids", None)  # a source that hands out lists: one tensor op per micro-batch
    if token_ids is not None:
        seqs = torch.tensor([token_ids(first + j) for j in range(mb)], dtype=torch.long)
    else:
        seqs = torch.stack([data.sequence(first + j) for j in range(mb)])
    if device is not None:
        seqs = seqs.to(device)
    return seqs[:, :-1], seqs[:, 1:]
