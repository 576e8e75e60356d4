"""TEST DOUBLES of an Intel XPU build of torch, for chipset-accelerator on a machine without one.

``FakeTorchXpuBuild`` stands in for the ``torch`` module the generic probe receives: its
``torch.accelerator`` reports ``xpu`` and ``torch.get_device_module("xpu")`` returns a
``FakeXpu``; ``torch.distributed`` is the real one (so ``xpu -> xccl`` is torch's own map).
``FakeXpu`` stands in for ``torch.xpu``: Max 1550 devices with fixed properties, allocator
statistics and RNG states in memory. Nothing here is a GPU: it checks chipset's mapping of
torch's device-module API, not Intel's runtime.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed

GiB = 2**30
MAX_1550 = ("Intel(R) Data Center GPU Max 1550", 128 * GiB)


class FakeXpu:
    """A ``torch.xpu`` double with ``len(gpus)`` devices: (name, total_memory) each."""

    def __init__(self, gpus=(MAX_1550, MAX_1550), bf16: bool = True):
        self._gpus = list(gpus)
        self._bf16 = bf16
        self._current = 0
        self.stats = [dict() for _ in self._gpus]
        self.rng = [torch.zeros(16, dtype=torch.uint8) for _ in self._gpus]

    def is_available(self):
        return bool(self._gpus)

    def device_count(self):
        return len(self._gpus)

    def set_device(self, i):
        self._current = i

    def current_device(self):
        return self._current

    def synchronize(self, i=None):
        pass

    def get_device_properties(self, i):
        name, mem = self._gpus[i]
        # torch.xpu's properties: Xe cores are "gpu_subslice_count", EUs "max_compute_units".
        return SimpleNamespace(name=name, total_memory=mem, gpu_subslice_count=128, max_compute_units=1024)

    def is_bf16_supported(self):
        return self._bf16

    def memory_stats(self, i):
        return dict(self.stats[i])

    def mem_get_info(self, i):
        return self._gpus[i][1] // 2, self._gpus[i][1]

    def get_rng_state(self, i):
        return self.rng[i].clone()

    def set_rng_state(self, state, i):
        self.rng[i] = state.clone()

    def manual_seed(self, seed):
        self.rng[self._current] = torch.full((16,), seed % 256, dtype=torch.uint8)


class FakeTorchXpuBuild:
    """A ``torch`` double of an XPU build (``available=False``: the build without a device)."""

    def __init__(self, available: bool = True, device_type: str = "xpu"):
        self.__version__ = "2.13.0+xpu.fake"
        self.xpu = FakeXpu() if available else FakeXpu(gpus=())
        self.accelerator = SimpleNamespace(current_accelerator=lambda: torch.device(device_type))
        self.distributed = torch.distributed
        self._type = device_type

    def get_device_module(self, kind):
        if kind != self._type:
            raise RuntimeError(f"Device '{kind}' does not have a corresponding module registered as 'torch.{kind}'.")
        return self.xpu


class FakeTorchCpuBuild:
    """A ``torch`` double of a CPU-only build: torch.accelerator reports nothing."""

    __version__ = "2.13.0+cpu.fake"
    accelerator = SimpleNamespace(current_accelerator=lambda: None)
