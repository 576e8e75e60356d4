"""Collectives for the simulator: real gloo process groups, each op accounted and faultable.

Every op passes through :meth:`SimCollective._run`, which counts calls, bytes (the
input tensors' bytes on this rank) and wall time per (op, group), and applies the
faults of ``CHIPSET_SIM_FAULTS`` (see :mod:`chipset_cpu_sim.faults`). Async ops are
timed until launch, not completion.

The ops themselves are chipset's shared host collective
(:class:`chipset.plugin_kit.host.HostCollective`): core's gloo ops plus the integer ``avg``
gloo lacks, done as a sum then a division rounding toward zero.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch.distributed as dist

from chipset.interfaces.collective import collective_timeout
from chipset.plugin_kit.host import HostCollective
from chipset_cpu_sim.faults import FaultPlan


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class SimCollective(HostCollective):
    backend_name = "cpu_sim"

    def __init__(self, device) -> None:
        super().__init__(device)
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        self.faults = FaultPlan.from_env()  # ConfigError on a malformed CHIPSET_SIM_FAULTS
        self.issued = 0
        """Collectives this process has issued (the ``collective=N`` counter of the faults)."""

    # --- accounting ------------------------------------------------------------
    def stats_dict(self) -> dict[str, dict]:
        """``{"op@group": {"calls", "bytes", "seconds"}}`` for reports and tests."""
        return {f"{op}@{g}": asdict(s) for (op, g), s in sorted(self.stats.items())}

    def reset_stats(self) -> None:
        self.stats.clear()

    def notify_step(self, step: int) -> None:
        if self.faults:
            self.faults.on_step(self._global_rank(), int(step))

    def notify_batch(self, step: int) -> None:
        if self.faults:  # slow_loader: the sleep falls inside the loop's data-wait timer
            self.faults.on_batch(self._global_rank())

    def notify_compute(self, step: int) -> None:
        if self.faults:  # host_delay: the sleep falls inside the step, between two operators
            self.faults.on_compute(self._global_rank())

    def loss_factor(self, step: int) -> float:
        return self.faults.loss_factor(int(step)) if self.faults else 1.0

    def _global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)

    def _run(self, op, group, tensors, fn, async_op, raw=False):
        index = self.issued
        self.issued += 1
        if self.faults:
            describe = f"{op} on {group.name} ({group.size} ranks)"
            self.faults.before_collective(self._global_rank(), index, describe, collective_timeout().total_seconds())
            lag = self.faults.link_delay_s(self._global_rank())
            if lag:  # a slow link: the extra time falls inside the op, so it is timed as communication
                fn = _lagged(fn, lag)
        corrupt = bool(self.faults) and not raw and self.faults.corrupts(self._global_rank(), op, tensors)
        t0 = time.perf_counter()
        try:
            handle = super()._run(op, group, tensors, fn, async_op, raw)
            return self.finish_after(handle, lambda: _corrupt(tensors[0])) if corrupt else handle
        finally:
            s = self.stats[(op, group.name)]
            s.calls += 1
            s.bytes += sum(t.numel() * t.element_size() for t in tensors)
            s.seconds += time.perf_counter() - t0


def _corrupt(tensor) -> None:
    """Silent data corruption: the first element off by one part in 1024 (and by 2**-10 if it is 0)."""
    flat = tensor.view(-1)
    if flat.numel():
        flat[0] += flat[0].abs() / 1024 + 2.0 ** -10


def _lagged(fn, seconds: float):
    def run():
        time.sleep(seconds)
        return fn()
    return run
