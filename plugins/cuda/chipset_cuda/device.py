"""NVIDIA and AMD GPUs through torch.cuda: what differs from chipset-accelerator's generic
device (streams, events, RNG and device calls are its delegation to the device module).

Visibility is the runtime's own: ``CUDA_VISIBLE_DEVICES`` (and, on ROCm,
``HIP_VISIBLE_DEVICES``) renumber the GPUs this process sees as 0..n-1 and every index
here is one of those. ``cuda`` is injectable so the unit tests can drive this module with
a named double of ``torch.cuda`` on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from chipset.errors import BackendUnavailableError
from chipset.interfaces import DeviceProperties
from chipset_accelerator.device import AcceleratorDevice
from chipset_cuda import VISIBLE_ENV
from chipset_cuda.properties import describe, hip_dtypes


def dtypes_for(compute_capability: tuple[int, int]) -> tuple[torch.dtype, ...]:
    """Tensor dtypes NVIDIA GPUs of this compute capability support natively."""
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool]
    if compute_capability >= (8, 0):  # bf16 tensor cores from Ampere on
        dtypes.append(torch.bfloat16)
    if compute_capability >= (8, 9):  # FP8 tensor cores: Ada, Hopper, Blackwell
        dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
    return tuple(dtypes)


class CudaDevice(AcceleratorDevice):
    backend_name = "cuda"
    device_type = "cuda"
    visible_devices_env = VISIBLE_ENV

    def __init__(self, cuda=None, hip: str | None = None) -> None:
        super().__init__("cuda", cuda if cuda is not None else torch.cuda)
        self.hip = torch.version.hip if hip is None and cuda is None else hip
        """The HIP version of a ROCm build of torch (AMD GPUs), None on NVIDIA."""
        if self.device_count() == 0:
            visible = os.environ.get(VISIBLE_ENV)
            hint = f" ({VISIBLE_ENV}={visible!r})" if visible is not None else ""
            check = "rocm-smi" if self.hip else "nvidia-smi"
            raise BackendUnavailableError(
                f"cuda: no GPU is visible to this process{hint}; check the driver with {check}, "
                f"widen {VISIBLE_ENV}, or choose another backend with CHIPSET_BACKEND."
            )

    def compute_capability(self, index: int | None = None) -> tuple[int, int]:
        i = self._check_index(self.current_device() if index is None else index)
        return tuple(self.module.get_device_capability(i))

    def min_compute_capability(self) -> tuple[int, int]:
        """The lowest compute capability among visible GPUs: what every rank can rely on."""
        return min(self.compute_capability(i) for i in range(self.device_count()))

    def gcn_arch(self, index: int = 0) -> str:
        """The AMD architecture (``"gfx942"``) of a GPU on a ROCm build; "" on NVIDIA."""
        name = getattr(self.module.get_device_properties(index), "gcnArchName", "") if self.hip else ""
        return str(name).split(":")[0]

    def _properties(self, index: int) -> DeviceProperties:
        p = self.module.get_device_properties(index)
        clock_khz = getattr(p, "clock_rate", None)  # not every torch build exposes it
        return describe(
            p.name,
            index,
            int(p.total_memory),
            (int(p.major), int(p.minor)),
            int(p.multi_processor_count),
            clock_hz=clock_khz * 1e3 if clock_khz else None,
            amd=bool(self.hip),
        )

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        if self.hip:
            return min((hip_dtypes(self.gcn_arch(i)) for i in range(self.device_count())), key=len)
        return dtypes_for(self.min_compute_capability())
