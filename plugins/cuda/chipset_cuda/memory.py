"""GPU memory: the caching allocator's statistics as MemoryStats, and CUDA OOM translation.

Mapping (``torch.cuda.memory_stats`` keys, all pools): ``allocated`` =
``allocated_bytes.all.current`` (live tensors), ``reserved`` = ``reserved_bytes.all.current``
(segments cudaMalloc'd by the allocator), ``active`` = ``active_bytes.all.current``
(blocks in use, including the allocator's rounding); ``peak_*`` are the ``.peak`` values.
"""

from __future__ import annotations

import re

import torch

from chipset.errors import OutOfMemoryError
from chipset.interfaces import Memory, MemoryStats

# Old and new torch formats: "(GPU 0; 7.93 GiB total capacity; ...)" and
# "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...".
_GPU_IN_MESSAGE = re.compile(r"\bGPU (\d+)\b")
# cuBLAS/cuDNN report their own allocation failures as RuntimeErrors.
_OOM_MARKERS = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


class CudaMemory(Memory):
    backend_name = "cuda"

    def __init__(self, device, cuda=None) -> None:
        self.device = device
        self._cuda = cuda if cuda is not None else torch.cuda

    def _index(self, index: int | None) -> int:
        return self.device._check_index(self.device.current_device() if index is None else index)

    def stats(self, index: int | None = None) -> MemoryStats:
        s = self._cuda.memory_stats(self._index(index))

        def get(key: str) -> int:
            return int(s.get(key, 0))

        return MemoryStats(
            allocated=get("allocated_bytes.all.current"),
            reserved=get("reserved_bytes.all.current"),
            active=get("active_bytes.all.current"),
            peak_allocated=get("allocated_bytes.all.peak"),
            peak_reserved=get("reserved_bytes.all.peak"),
            peak_active=get("active_bytes.all.peak"),
        )

    def reset_peak_stats(self, index: int | None = None) -> None:
        self._cuda.reset_peak_memory_stats(self._index(index))

    def empty_cache(self) -> None:
        self._cuda.empty_cache()

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        free, total = self._cuda.mem_get_info(self._index(index))
        return int(free), int(total)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    # --- OOM -------------------------------------------------------------------
    def translate_oom(self, exc: BaseException, device: str = "") -> OutOfMemoryError | None:
        """As the core template; the device defaults to the GPU the message names."""
        if not device:
            m = _GPU_IN_MESSAGE.search(str(exc))
            device = f"cuda:{m.group(1)}" if m else ""
        return super().translate_oom(exc, device)

    def _is_oom(self, exc: BaseException) -> bool:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and any(k in str(exc) for k in _OOM_MARKERS)
