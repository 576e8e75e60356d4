"""Device memory through the device module's caching allocator, and its OOM as chipset's.

torch's device allocators (CUDA, ROCm, XPU, torch_npu, PrivateUse1 vendors built on
c10's caching allocator) share one statistics layout, so ``memory_stats`` has
``allocated_bytes.all.current`` and friends; ``allocated``/``reserved``/``active`` and
their peaks map onto MemoryStats one to one.
"""

from __future__ import annotations

import torch

from chipset.interfaces import Memory, MemoryStats

STAT_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "active": "active_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "peak_reserved": "reserved_bytes.all.peak",
    "peak_active": "active_bytes.all.peak",
}


class AcceleratorMemory(Memory):
    backend_name = "accelerator"
    oom_markers: tuple[str, ...] = ("out of memory",)
    """Lower-case texts that mark a RuntimeError as this device's OOM (older runtimes raise those)."""

    def __init__(self, device, module=None) -> None:
        self.device = device
        self._explicit_module = module

    @property
    def module(self):
        return self._explicit_module if self._explicit_module is not None else self.device.module

    def _index(self, index: int | None) -> int:
        """The torch index of visible device ``index`` (default: current)."""
        i = self.device._check_index(self.device.current_device() if index is None else index)
        phys = getattr(self.device, "_phys", None)
        return i if phys is None else phys(i)

    def stats(self, index: int | None = None) -> MemoryStats:
        raw = self.module.memory_stats(self._index(index))
        # An allocator that has never allocated returns an empty dict: all zeros.
        return MemoryStats(**{field: int(raw.get(key, 0)) for field, key in STAT_KEYS.items()})

    def reset_peak_stats(self, index: int | None = None) -> None:
        self.module.reset_peak_memory_stats(self._index(index))

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        free, total = self.module.mem_get_info(self._index(index))
        return int(free), int(total)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def _is_oom(self, exc: BaseException) -> bool:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in self.oom_markers)
