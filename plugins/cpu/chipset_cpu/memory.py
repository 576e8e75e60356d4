"""Host memory as the process sees it: resident set size and its high-water mark.

torch keeps no statistics for CPU allocations, and counting each tensor would take a
Python call per aten op (what cpu_sim does to simulate a device; docs/cpu_sim.md
measures it). This backend exists to run at torch's own speed, so it reports the
process: ``allocated`` = ``reserved`` = ``active`` = resident memory (``VmRSS``), the
peaks = its high-water mark (``VmHWM``). ``reset_peak_stats`` resets the kernel's mark
(``/proc/self/clear_refs``, Linux); where that is refused the peak is the process
lifetime's. Capabilities declare ``memory_accounting="process"``, so the conformance
suite skips the per-tensor exactness checks. Nothing enforces a capacity: the host's
memory is the limit, and torch raises its own out-of-memory error past it.
"""

from __future__ import annotations

import logging
import resource

import torch

from chipset.interfaces import Memory, MemoryStats
from chipset_cpu.device import host_memory

log = logging.getLogger(__name__)


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rss = hwm
    return rss, max(hwm, rss)


class CpuMemory(Memory):
    backend_name = "cpu"

    def __init__(self, device) -> None:
        self.device = device
        self._warned = False

    def stats(self, index: int | None = None) -> MemoryStats:
        self._index(index)
        rss, hwm = _status()
        return MemoryStats(rss, rss, rss, hwm, hwm, hwm)

    def reset_peak_stats(self, index: int | None = None) -> None:
        self._index(index)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.info("cannot reset the resident-memory high-water mark (%s); peaks cover the whole process", exc)

    def empty_cache(self) -> None:
        pass  # torch's CPU allocator returns freed blocks to the C allocator at once

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        self._index(index)
        return host_memory()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()  # the host is the device

    def _index(self, index: int | None) -> int:
        return self.device._check_index(self.device.current_device() if index is None else index)
