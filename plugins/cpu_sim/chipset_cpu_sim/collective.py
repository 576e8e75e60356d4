"""Collectives for the simulator: real gloo process groups, each op accounted and faultable.

Every op passes through :meth:`SimCollective._run`, which counts calls, bytes (the
input tensors' bytes on this rank) and wall time per (op, group), and applies the
faults of ``CHIPSET_SIM_FAULTS`` (see :mod:`chipset_cpu_sim.faults`). Async ops are
timed until launch, not completion.

Emulated on top of gloo (torch 2.13 gloo refuses them): ``avg`` of integer tensors in
``all_reduce`` and ``reduce_scatter``, done as a sum followed by an integer division
rounding toward zero (``torch.div(..., rounding_mode="trunc")``), which is what the
float result cast back would give for non-negative values.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from chipset.interfaces import Collective, Handle
from chipset.interfaces.collective import _expect_numel, _reduce_op, collective_timeout
from chipset_cpu_sim.faults import FaultPlan

# torch 2.13 deprecates the *_into_tensor / *_tensor spellings in favour of *_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class _ThenHandle(Handle):
    """An async handle that runs a finishing step (the emulation's division) after ``wait``."""

    def __init__(self, inner: Handle, then: Callable[[], object]):
        self._inner = inner
        self._then = then
        self._done = False

    def wait(self) -> None:
        self._inner.wait()
        if not self._done:
            self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._inner.is_completed()


def _emulated_int_avg(tensor: torch.Tensor, op: str) -> bool:
    return op == "avg" and not (tensor.is_floating_point() or tensor.is_complex())


class SimCollective(Collective):
    backend_name = "cpu_sim"
    c10d_backend = "gloo"

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

    def _global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)

    def _run(self, op, group, tensors, fn, async_op, raw=False):
        index = self.issued
        self.issued += 1
        if self.faults:
            describe = f"{op} on {group.name} ({group.size} ranks)"
            self.faults.before_collective(self._global_rank(), index, describe, collective_timeout().total_seconds())
        t0 = time.perf_counter()
        try:
            return super()._run(op, group, tensors, fn, async_op, raw)
        finally:
            s = self.stats[(op, group.name)]
            s.calls += 1
            s.bytes += sum(t.numel() * t.element_size() for t in tensors)
            s.seconds += time.perf_counter() - t0

    # --- ops gloo lacks or spells differently ------------------------------------
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if not _emulated_int_avg(tensor, op):
            return super().all_reduce(tensor, op, group, async_op)
        g = group or self.world
        h = super().all_reduce(tensor, "sum", group, async_op)
        return self._then(h, lambda: tensor.div_(g.size, rounding_mode="trunc"))

    def all_gather(self, output, input, group=None, async_op=False):
        g = group or self.world
        _expect_numel(output, input.numel() * g.size, "all_gather output")
        return self._run(
            "all_gather", g, [input],
            lambda: _all_gather_single(output, input, group=g.pg, async_op=async_op), async_op,
        )

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        g = group or self.world
        _expect_numel(input, output.numel() * g.size, "reduce_scatter input")
        emulate = _emulated_int_avg(input, op)
        rop = _reduce_op("sum" if emulate else op)
        h = self._run(
            "reduce_scatter", g, [input],
            lambda: _reduce_scatter_single(output, input, rop, group=g.pg, async_op=async_op), async_op,
        )
        if not emulate:
            return h
        return self._then(h, lambda: output.div_(g.size, rounding_mode="trunc"))

    @staticmethod
    def _then(handle: Handle | None, then: Callable[[], object]):
        if handle is None:
            then()
            return None
        return _ThenHandle(handle, then)
