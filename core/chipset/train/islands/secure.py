"""Secure aggregation between islands: pairwise additive masks that cancel in the sum.

Each client (rank ``r`` of each island) encodes its update as fixed-point integers modulo
``M = 2^48`` and adds, for every other client ``j`` of the round, a mask ``+m_ij`` (``i < j``)
or ``-m_ji`` (``i > j``), uniform modulo ``M``. The all-reduce sums the masked vectors; every
pair's masks cancel, so the sum modulo ``M`` is the sum of the updates, while each masked vector
(and any partial sum of fewer than all clients, as a ring all-reduce passes along) is uniform
modulo ``M``, independent of the update it hides.

A pair's masks come from a seed only the two clients know: each client draws an X25519 key
(RFC 7748, computed here from the curve's formulas), publishes the public half on the islands'
store, and derives the pair's shared secret from the other's public key (Diffie-Hellman). The
store, and whoever hosts it, sees public keys only. A round's mask is SHAKE-256 of the secret
and the round's key (fresh masks on every try, so a retried round never reuses one).

Not provided (see docs/islands.md): recovery from a client lost mid-round (SecAgg's secret
sharing; here the round is retried without it, with fresh masks), and authentication of the
public keys (an active attacker on the store could stand in the middle).
"""

from __future__ import annotations

import hashlib
import math
import secrets

import torch

__all__ = ["MODULUS_BITS", "SecureSum", "x25519", "x25519_base", "encode", "decode_sum", "scale_for"]

MODULUS_BITS = 48
"""Masked values live modulo 2^48, sent as int64: a sum of up to 2^14 clients cannot overflow."""
_M = 1 << MODULUS_BITS
_P = 2 ** 255 - 19
_A24 = 121665


def x25519(scalar: bytes, u: bytes) -> bytes:
    """X25519 (RFC 7748, section 5): the Montgomery ladder on Curve25519."""
    k = bytearray(scalar)
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    k_int = int.from_bytes(k, "little")
    x1 = int.from_bytes(u, "little") & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    for t in reversed(range(255)):
        bit = (k_int >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = (x2 + z2) % _P, (x2 - z2) % _P
        aa, bb = a * a % _P, b * b % _P
        e = (aa - bb) % _P
        c, d = (x3 + z3) % _P, (x3 - z3) % _P
        da, cb = d * a % _P, c * b % _P
        x3 = (da + cb) ** 2 % _P
        z3 = x1 * (da - cb) ** 2 % _P
        x2 = aa * bb % _P
        z2 = e * (aa + _A24 * e) % _P
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, _P - 2, _P) % _P).to_bytes(32, "little")


def x25519_base(scalar: bytes) -> bytes:
    """The public key of ``scalar``: X25519 with the base point u = 9."""
    return x25519(scalar, (9).to_bytes(32, "little"))


def encode(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Fixed point modulo 2^48: ``round(x * scale) mod M`` as int64 (float64 on the way: exact
    for |x * scale| < 2^53)."""
    return torch.remainder(torch.round(x.double() * scale).to(torch.int64), _M)


def decode_sum(total: torch.Tensor, scale: float) -> torch.Tensor:
    """The signed float value of a sum of encodings (``total`` summed in int64), modulo M
    centred on 0."""
    r = torch.remainder(total, _M)
    r = torch.where(r >= _M // 2, r - _M, r)
    return (r.double() / scale).float()


def scale_for(bound: float) -> float:
    """The fixed-point scale: the largest power of two that keeps a sum within ``bound`` inside
    (-M/2, M/2), i.e. decodable without wrapping (resolution ``1 / scale``)."""
    return float(2 ** (MODULUS_BITS - 1 - max(1, math.ceil(bound)).bit_length()))


class SecureSum:
    """One client's half of the protocol (rank ``local_rank`` of island ``island``)."""

    def __init__(self, store, island: int, count: int, local_rank: int):
        self.island, self.count, self.local_rank = island, count, local_rank
        self._secret = secrets.token_bytes(32)
        self.public = x25519_base(self._secret)
        self._store = store
        self._shared: dict[int, bytes] = {}
        store.set(self._key(island), self.public.hex())

    def _key(self, island: int) -> str:
        return f"secagg/r{self.local_rank}/{island}"

    def _secret_with(self, other: int) -> bytes:
        if other not in self._shared:  # a restarted client has a new key: read it again on every new round
            pub = bytes.fromhex(self._store.get(self._key(other)).decode())
            self._shared[other] = hashlib.sha256(x25519(self._secret, pub)).digest()
        return self._shared[other]

    def forget(self) -> None:
        """Read the peers' public keys again (the clients of a round changed)."""
        self._shared.clear()

    def mask(self, other: int, round_key: str, n: int) -> torch.Tensor:
        """The pair's mask for ``round_key``: ``n`` values uniform modulo 2^48, the same on both sides."""
        lo, hi = sorted((self.island, other))
        raw = hashlib.shake_256(self._secret_with(other) + f"{lo}/{hi}/{round_key}".encode()).digest(8 * n)
        return torch.frombuffer(bytearray(raw), dtype=torch.int64) & (_M - 1)

    def masked(self, x: torch.Tensor, scale: float, members: tuple[int, ...], round_key: str) -> torch.Tensor:
        """What this client sends: its encoded ``x`` plus its masks with every other member, mod M."""
        y = encode(x, scale)
        for other in members:
            if other == self.island:
                continue
            m = self.mask(other, round_key, y.numel())
            y = y + m if self.island < other else y - m
        return torch.remainder(y, _M)
