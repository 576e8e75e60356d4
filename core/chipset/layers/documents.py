"""Document boundaries inside packed windows (``data.document_mask``).

A training window packs several documents, each ending with the end-of-sequence id. With
document masks a token attends only to earlier tokens of its own document and its rotary
position counts from the document's first token, so the window computes exactly what each
document would alone (the loss of a window is the token-weighted mean of its documents').
"""

from __future__ import annotations

import torch

__all__ = ["document_ids", "document_positions", "document_mask"]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(b, s) int64: how many documents end before each token (the token after an ``eos_id``
    starts the next document; the ``eos_id`` itself belongs to the one it ends)."""
    ends = (tokens == eos_id).long()
    return torch.cumsum(ends, dim=-1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(b, s) int64: each token's position within its document (0 at a document's first token)."""
    s = docs.shape[-1]
    pos = torch.arange(s, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.where(starts, pos, torch.zeros_like(pos))
    return pos - torch.cummax(first, dim=-1).values


def document_mask(docs_q: torch.Tensor, docs_k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """(b, 1, sq, sk) bool, True = attend: the key (global position ``kpos``) is at or before
    the query (``qpos``) and in the same document."""
    same = docs_q.unsqueeze(-1) == docs_k.unsqueeze(-2)
    return (same & (kpos.unsqueeze(0) <= qpos.unsqueeze(1))).unsqueeze(1)
