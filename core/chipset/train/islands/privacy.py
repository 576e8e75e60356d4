"""Differential privacy of a federated islands run: the Renyi-DP accountant.

Every outer step (a round) each client clips its update to L2 norm ``C`` (``islands.clip_norm``)
and adds Gaussian noise of standard deviation ``z * C / sqrt(n)`` per element (``z``:
``islands.noise_multiplier``, ``n``: the round's clients), so the sum the aggregator learns
carries noise ``z * C``: the Gaussian mechanism with sensitivity ``C`` under client-level
add/remove adjacency (DP-FedAvg). This module counts what that costs.

Renyi DP of order ``a`` (Mironov 2017): a mechanism is ``(a, r)``-RDP when the Renyi
divergence of order ``a`` between its outputs on neighbouring inputs is at most ``r``.

- Gaussian mechanism, noise ``z`` times the sensitivity: ``r(a) = a / (2 z^2)`` for every a > 1.
- Its Poisson-subsampled version at rate ``q`` (Mironov, Talwar, Zhang 2019, integer ``a >= 2``):
  ``r(a) = log(sum_k binom(a, k) (1-q)^(a-k) q^k exp((k^2 - k) / (2 z^2))) / (a - 1)``;
  at ``q = 1`` only ``k = a`` remains and it is the line above.
- Composition: the RDP of ``T`` rounds is ``T`` times one round's, order by order.
- To ``(epsilon, delta)`` (Canonne, Kamath, Steinke 2020, Prop. 12; Balle et al. 2020):
  ``epsilon = r(a) + log((a-1)/a) - (log(delta) + log(a)) / (a-1)``, minimised over the orders
  (always below the classical ``r(a) + log(1/delta) / (a-1)``, which is kept for comparison).

Every formula is computed in log space (``logsumexp``), so large orders do not overflow.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ORDERS", "Spent", "gaussian_rdp", "rdp_to_epsilon", "rdp_to_epsilon_classical", "epsilon_spent", "rounds_spent"]

ORDERS: tuple[float, ...] = (*(1 + x / 10 for x in range(1, 100)), *range(11, 64), 80, 96, 128, 192, 256, 512, 1024)
"""The Renyi orders the accountant minimises over (fractional ones below 11 only at q = 1)."""


@dataclass(frozen=True)
class Spent:
    """The privacy a run spent: ``epsilon`` at ``delta``, reached at Renyi order ``order``."""

    epsilon: float
    delta: float
    order: float
    noise_multiplier: float
    sample_rate: float
    rounds: int

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "order": self.order,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "rounds": self.rounds, "accountant": "rdp"}


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return m
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def gaussian_rdp(order: float, noise_multiplier: float, sample_rate: float = 1.0) -> float:
    """RDP of one round of the (Poisson-subsampled at ``sample_rate``) Gaussian mechanism with
    noise ``noise_multiplier`` times the sensitivity, at Renyi order ``order`` (> 1; an integer
    when ``sample_rate < 1``). ``inf`` without noise; 0 when nobody is sampled."""
    if order <= 1:
        raise ValueError(f"Renyi order {order!r}: expected > 1")
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample rate {sample_rate!r}: expected a value in [0, 1]")
    if sample_rate == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    z2 = noise_multiplier ** 2
    if sample_rate == 1:
        return order / (2 * z2)
    if order != int(order):
        raise ValueError(f"Renyi order {order!r}: the subsampled Gaussian is computed at integer orders only")
    a = int(order)
    lq, l1q = math.log(sample_rate), math.log1p(-sample_rate)
    terms = [_log_binom(a, k) + (a - k) * l1q + k * lq + (k * k - k) / (2 * z2) for k in range(a + 1)]
    return max(0.0, _logsumexp(terms)) / (a - 1)


def rdp_to_epsilon(rdp: Sequence[float], orders: Sequence[float], delta: float) -> tuple[float, float]:
    """(epsilon, the order reaching it) of a mechanism with RDP ``rdp[i]`` at ``orders[i]``."""
    if not 0 < delta < 1:
        raise ValueError(f"delta {delta!r}: expected a value in (0, 1)")
    best = (math.inf, math.nan)
    for a, r in zip(orders, rdp, strict=True):
        eps = r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        if eps < best[0]:
            best = (eps, a)
    return max(0.0, best[0]), best[1]


def rdp_to_epsilon_classical(rdp: Sequence[float], orders: Sequence[float], delta: float) -> float:
    """Mironov's original conversion ``min_a r(a) + log(1/delta) / (a-1)`` (looser; for comparison)."""
    return max(0.0, min(r + math.log(1 / delta) / (a - 1) for a, r in zip(orders, rdp, strict=True)))


def epsilon_spent(noise_multiplier: float, rounds: int, delta: float, sample_rate: float = 1.0,
                  orders: Sequence[float] = ORDERS) -> Spent:
    """The ``(epsilon, delta)`` of ``rounds`` rounds of the Gaussian mechanism (subsampled at
    ``sample_rate``) with noise ``noise_multiplier`` times the clip norm."""
    if rounds < 0:
        raise ValueError(f"rounds {rounds!r}: expected >= 0")
    return rounds_spent([noise_multiplier] * rounds, delta, sample_rate, orders)


def rounds_spent(noise_multipliers: Sequence[float], delta: float, sample_rate: float = 1.0,
                 orders: Sequence[float] = ORDERS) -> Spent:
    """:func:`epsilon_spent` of rounds that each had their own noise multiplier (composed order by order)."""
    rounds = len(noise_multipliers)
    low = min(noise_multipliers, default=0.0)
    if rounds == 0:
        return Spent(0.0, delta, math.nan, low, sample_rate, 0)
    use = [a for a in orders if sample_rate == 1 or a == int(a)]
    counts = Counter(noise_multipliers)  # equal rounds computed once
    rdp = [sum(k * gaussian_rdp(a, z, sample_rate) for z, k in counts.items()) for a in use]
    eps, order = rdp_to_epsilon(rdp, use, delta)
    return Spent(eps, delta, order, low, sample_rate, rounds)
