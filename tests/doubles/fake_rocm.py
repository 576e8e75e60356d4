"""TEST DOUBLES of a ROCm build of torch (AMD GPUs through torch.cuda on HIP), for chipset-cuda
on a machine without one.

``FakeTorchRocmForProbe``: the ``torch`` module the probe receives. ``version.hip`` is set and
``version.cuda`` is None, as on ROCm wheels; ``torch.cuda`` answers only what a fork-safe
probe may call (amdsmi's raw device count, ``is_available`` under
``PYTORCH_NVML_BASED_CUDA_CHECK=1``) and fails the test on anything else.
``FakeRocmCuda``: ``torch.cuda`` behind CudaDevice on ROCm: properties carry
``gcnArchName`` and HIP's compute capability (gfx942 -> 9.4). Nothing here is a GPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from doubles.fake_cuda import FakeCuda, ProbeTouchedCuda

GiB = 2**30
MI300X = ("AMD Instinct MI300X", 191.98 * GiB, (9, 4), 304, "gfx942:sramecc+:xnack-")
MI250X_GCD = ("AMD Instinct MI250X", 64 * GiB, (9, 0), 110, "gfx90a:sramecc+:xnack-")


class _ProbeHipCuda:
    def __init__(self, present):
        self._present = present

    def _raw_device_count_amdsmi(self) -> int:
        if self._present == "oserror":
            raise OSError("libamd_smi.so: cannot open shared object file: No such file or directory")
        return self._present

    def is_available(self) -> bool:
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
            raise ProbeTouchedCuda("is_available() without PYTORCH_NVML_BASED_CUDA_CHECK=1 initialises HIP")
        visible = os.environ.get("HIP_VISIBLE_DEVICES")
        return self._present not in ("oserror", -1, 0) and visible != "99"

    def __getattr__(self, name):
        raise ProbeTouchedCuda(f"the probe used torch.cuda.{name}, which may initialise HIP")


class FakeTorchRocmForProbe:
    """A ``torch`` double of a ROCm build; ``present`` is amdsmi's count (-1: no driver)."""

    def __init__(self, present=8, hip: str = "6.4.43482"):
        self.__version__ = "2.13.0+rocm6.4.fake"
        self.version = SimpleNamespace(cuda=None, hip=hip)
        self.cuda = _ProbeHipCuda(present)


class FakeRocmCuda(FakeCuda):
    """``torch.cuda`` on a ROCm build with ``gpus``: (name, memory, (major, minor), CUs, gcnArchName)."""

    def __init__(self, gpus=(MI300X, MI300X)):
        super().__init__(gpus=[g[:4] for g in gpus])
        self._arch = [g[4] for g in gpus]

    def get_device_properties(self, i):
        p = super().get_device_properties(i)
        p.gcnArchName = self._arch[i]
        return p
