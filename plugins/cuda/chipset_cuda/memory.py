"""GPU memory: chipset-accelerator's caching-allocator statistics, plus CUDA's OOM texts.

Mapping (``torch.cuda.memory_stats`` keys, all pools): ``allocated`` =
``allocated_bytes.all.current`` (live tensors), ``reserved`` = ``reserved_bytes.all.current``
(segments cudaMalloc'd by the allocator), ``active`` = ``active_bytes.all.current``
(blocks in use, including the allocator's rounding); ``peak_*`` are the ``.peak`` values.
"""

from __future__ import annotations

import re

from chipset.errors import OutOfMemoryError
from chipset_accelerator.memory import AcceleratorMemory

# Old and new torch formats: "(GPU 0; 7.93 GiB total capacity; ...)" and
# "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...".
_GPU_IN_MESSAGE = re.compile(r"\bGPU (\d+)\b")


class CudaMemory(AcceleratorMemory):
    backend_name = "cuda"
    # cuBLAS/cuDNN (hipBLAS on ROCm) report their own allocation failures as RuntimeErrors.
    oom_markers = ("cuda out of memory", "hip out of memory", "cublas_status_alloc_failed",
                   "cudnn_status_alloc_failed", "hipblas_status_alloc_failed")

    def __init__(self, device, cuda=None) -> None:
        super().__init__(device, cuda)

    def translate_oom(self, exc: BaseException, device: str = "") -> OutOfMemoryError | None:
        """As the core template; the device defaults to the GPU the message names."""
        if not device:
            m = _GPU_IN_MESSAGE.search(str(exc))
            device = f"cuda:{m.group(1)}" if m else ""
        return super().translate_oom(exc, device)
