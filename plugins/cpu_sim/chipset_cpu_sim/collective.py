"""Collectives for the simulator: real gloo process groups, with per-op accounting."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from chipset.interfaces import Collective


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class SimCollective(Collective):
    backend_name = "cpu_sim"
    c10d_backend = "gloo"

    def __init__(self, device) -> None:
        super().__init__(device)
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)

    def _run(self, op, group, tensors, fn, async_op, raw=False):
        t0 = time.perf_counter()
        try:
            return super()._run(op, group, tensors, fn, async_op, raw)
        finally:
            s = self.stats[(op, group.name)]
            s.calls += 1
            s.bytes += sum(t.numel() * t.element_size() for t in tensors)
            s.seconds += time.perf_counter() - t0
