"""NPU memory through torch.npu's caching allocator, and torch_npu's OOM as chipset's.

torch_npu's allocator keeps the CUDA allocator's statistics layout, so
``torch.npu.memory_stats`` has ``allocated_bytes.all.current`` and friends.
"""

from __future__ import annotations

import re

import torch

from chipset.errors import OutOfMemoryError
from chipset.interfaces import Memory, MemoryStats
from chipset_ascend._runtime import DEVICE_TYPE, npu

# torch_npu's allocator message, e.g. "NPU out of memory. Tried to allocate 52.00 MiB
# (NPU 0; 60.96 GiB total capacity; ...)". Older torch_npu raises RuntimeError with
# it, newer raises torch.OutOfMemoryError; both are recognised.
_OOM_MARKER = "npu out of memory"
_DEVICE_IN_MESSAGE = re.compile(r"\(NPU (\d+);")

_STAT_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "active": "active_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "peak_reserved": "reserved_bytes.all.peak",
    "peak_active": "active_bytes.all.peak",
}


class AscendMemory(Memory):
    backend_name = "ascend"

    def __init__(self, device) -> None:
        self.device = device

    def _index(self, index: int | None) -> int:
        return self.device._check_index(self.device.current_device() if index is None else index)

    def stats(self, index: int | None = None) -> MemoryStats:
        raw = npu().memory_stats(self._index(index))
        # An allocator that has never allocated returns an empty dict: all zeros.
        return MemoryStats(**{field: int(raw.get(key, 0)) for field, key in _STAT_KEYS.items()})

    def reset_peak_stats(self, index: int | None = None) -> None:
        npu().reset_peak_memory_stats(self._index(index))

    def empty_cache(self) -> None:
        npu().empty_cache()

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        free, total = npu().mem_get_info(self._index(index))
        return int(free), int(total)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    # --- OOM translation: only the narrow hooks, the message is core's --------
    def translate_oom(self, exc: BaseException, device: str = "") -> OutOfMemoryError | None:
        if not device and not isinstance(exc, OutOfMemoryError):
            m = _DEVICE_IN_MESSAGE.search(str(exc))
            if m:
                device = f"{DEVICE_TYPE}:{m.group(1)}"
        return super().translate_oom(exc, device)

    def _is_oom(self, exc: BaseException) -> bool:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and _OOM_MARKER in str(exc).lower()
