"""Synthetic, deterministic language-modelling data (no downloads).

Sequence ``i`` of the stream depends only on ``(seed, i)``: a seeded random walk through a
fixed permutation of the vocabulary with 10% random jumps, so a model can learn it (the
loss falls visibly within a few dozen steps) and every layout sees identical tokens.

Sharding: the global batch of step ``s`` is sequences ``s*G .. s*G+G-1``; data-parallel
rank ``r`` takes the contiguous ``G/dp`` block starting at ``r*G/dp`` and splits it into
micro-batches in order. Any dp x micro_batches split therefore covers the same global
batch as a single process.
"""

from __future__ import annotations

import torch

__all__ = ["SyntheticTokens"]


class SyntheticTokens:
    """A seeded token stream; ``batch(step, dp_rank, dp, micro, micro_batches)`` -> (tokens, targets)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int = 0, jump: float = 0.1):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.jump = jump
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        self.perm = torch.randperm(vocab_size, generator=g)

    def sequence(self, index: int) -> torch.Tensor:
        """Sequence ``index`` of the stream: ``seq_len + 1`` token ids (int64)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_len + 1
        start = torch.randint(self.vocab_size, (1,), generator=g)
        jumps = torch.rand(n, generator=g) < self.jump
        rand = torch.randint(self.vocab_size, (n,), generator=g)
        out = torch.empty(n, dtype=torch.long)
        cur = int(start)
        for i in range(n):
            cur = int(rand[i]) if jumps[i] else int(self.perm[cur])
            out[i] = cur
        return out

    def batch(self, step: int, dp_rank: int = 0, dp: int = 1, micro: int = 0, micro_batches: int = 1,
              device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = step * self.global_batch + dp_rank * per_rank + micro * mb
        seqs = torch.stack([self.sequence(first + j) for j in range(mb)])
        if device is not None:
            seqs = seqs.to(device)
        return seqs[:, :-1], seqs[:, 1:]
