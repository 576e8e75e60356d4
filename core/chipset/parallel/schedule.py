"""Pipeline schedules by name, and their bubble: declared once for the config, the runtime and
the planner.

``parallel.schedule`` takes one of :data:`SCHEDULES`; the runtime builds it
(:mod:`chipset.runtime.pipeline.schedules`), the planner plans it under the same name (a plan
labels the interleaved schedule ``interleaved-vN``), and both use :func:`bubble_fraction`.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""GPipe (all forwards, then all backwards), 1F1B (one forward, one backward after the warm-up),
interleaved 1F1B (``virtual_stages`` model chunks per rank, Narayanan et al. 2021)."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle pipeline time over ideal time (docs/formulas.md): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v*m) interleaved."""
    return (stages - 1) / (virtual_stages * micro_batches)
