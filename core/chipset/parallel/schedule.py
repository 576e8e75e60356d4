"""Pipeline schedules by name, and their bubble: declared once for the config, the runtime and
the planner.

``parallel.schedule`` takes one of :data:`SCHEDULES`; the runtime builds it
(:mod:`chipset.runtime.pipeline.schedules`), the planner plans it under the same name (a plan
labels the interleaved schedule ``interleaved-vN``), and both use :func:`bubble_fraction`.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
"""GPipe (all forwards, then all backwards), 1F1B (one forward, one backward after the warm-up),
interleaved 1F1B (``virtual_stages`` model chunks per rank, Narayanan et al. 2021), zero bubble
(ZB-H1, Qi et al. 2023: each backward split into its input- and weight-gradient halves, the
weight halves filling 1F1B's idle time), ZBV (zero bubble on two chunks per rank placed in a V,
Qi et al. 2024)."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle pipeline time over ideal time (docs/formulas.md): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v*m) interleaved, max(p-1, 2p-1-m)/(3m) zero bubble (from m >= p ZB-H1's (p-1)(F+B-W)
    idle time over m(F+B+W), with a backward's input and weight halves each as long as a forward;
    with fewer micro-batches the first rank waits out the whole round trip), and for ZBV
    max(p-1, 4p-2-2m) chunk units over 2m chunks' F+B+W: from m >= (3p-1)/2 its ranks idle only while
    the first micro-batch's activation reaches the last one (p-1 chunk forwards, (p-1)/(6m)); with
    fewer micro-batches rank 0 also waits for them to come back round the V. The zero-bubble and ZBV
    values are the runtime's schedules' exactly, as :func:`chipset.runtime.pipeline.check.check_schedule`
    times them (unit tests compare them for p = 2, 3, 4, 5, 8 and m from 1 to 3p)."""
    if schedule == "zbv":
        p, m = stages, micro_batches
        return max(p - 1, 4 * p - 2 - 2 * m) / (6 * m)
    if schedule == "zero_bubble":
        p, m = stages, micro_batches
        return max(p - 1, 2 * p - 1 - m) / (3 * m)
    return (stages - 1) / (virtual_stages * micro_batches)
