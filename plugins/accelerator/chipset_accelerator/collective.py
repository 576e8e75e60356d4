"""Collectives through the c10d backend torch names for the device type
(``torch.distributed.get_default_backend_for_device``: xccl for XPU, nccl for CUDA/ROCm,
what a PrivateUse1 vendor registered for its type)."""

from __future__ import annotations

from chipset.errors import BackendUnavailableError
from chipset.interfaces import Collective
from chipset.interfaces.collective import divide_for_avg_
from chipset_accelerator import distributed_backend
from chipset_accelerator.memory import AcceleratorMemory


class AcceleratorCollective(Collective):
    backend_name = "accelerator"

    def __init__(self, device) -> None:
        super().__init__(device)
        self._memory = AcceleratorMemory(device)
        self.c10d_backend = distributed_backend(device.accelerator_type) or ""

    def init_process_group(self, **kwargs):
        if not self.c10d_backend:
            raise BackendUnavailableError(
                f"accelerator: torch has no distributed backend for device type {self.device.accelerator_type!r} "
                "(torch.distributed.get_default_backend_for_device); run one process, or install the vendor "
                "package that registers its collective library"
            )
        return super().init_process_group(**kwargs)

    # Not every collective library has AVG (gloo and HCCL lack it; gloo has none for
    # integers): "avg" is a SUM then a local division, which every library can do.
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if op != "avg":
            return super().all_reduce(tensor, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().all_reduce(tensor, "sum", group, async_op), lambda: divide_for_avg_(tensor, n))

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if op != "avg":
            return super().reduce_scatter(output, input, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().reduce_scatter(output, input, "sum", group, async_op),
                                 lambda: divide_for_avg_(output, n))

    def _translate(self, exc: BaseException, describe: str) -> BaseException:
        # Collective libraries need device buffers; running out of them is an OOM.
        oom = self._memory.translate_oom(exc)
        return oom if oom is not None else super()._translate(exc, describe)
