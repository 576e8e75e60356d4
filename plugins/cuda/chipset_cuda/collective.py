"""Collectives on NVIDIA GPUs: torch.distributed with the NCCL process-group backend.

Each rank must make its GPU current (``device.set_device(local_rank)``, as the engine
does) before ``init_process_group``; NCCL binds a communicator to the current device.
"""

from __future__ import annotations

from chipset.interfaces import Collective
from chipset_cuda.memory import CudaMemory


class CudaCollective(Collective):
    backend_name = "cuda"
    c10d_backend = "nccl"

    def __init__(self, device) -> None:
        super().__init__(device)
        self._memory = CudaMemory(device)

    def _translate(self, exc: BaseException, describe: str) -> BaseException:
        # NCCL needs device buffers; running out of them is an OOM, not a broken transport.
        oom = self._memory.translate_oom(exc)
        if oom is not None:
            return oom
        return super()._translate(exc, describe)
