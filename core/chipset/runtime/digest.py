"""A layout-independent digest of a model's parameters, computed one parameter at a time.

``digest = SHA-256 over the sorted parameter names of SHA-256(name, 0, float32 bytes)``: each
parameter is hashed on its own, so an engine can hash them as it unshards them, bucket by
bucket, and keep 32 bytes per parameter instead of the whole model (a 7B model's unsharded
float32 copy is 28 GB per rank). The same parameters give the same digest under every layout.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["param_hash", "combine", "params_digest"]


def param_hash(name: str, tensor: torch.Tensor) -> bytes:
    """SHA-256 of ``name`` and ``tensor``'s values as contiguous float32 (32 bytes)."""
    h = hashlib.sha256(name.encode())
    h.update(b"\0")
    h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.digest()


def combine(hashes: dict[str, bytes]) -> str:
    """The digest (hex) of per-parameter hashes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(hashes):
        h.update(hashes[name])
    return h.hexdigest()


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """The digest of unsharded parameters by single-process name (what an engine's
    ``params_digest()`` computes shard by shard)."""
    return combine({n: param_hash(n, t) for n, t in params.items()})
