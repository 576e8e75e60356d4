"""TEST DOUBLE of a PrivateUse1 vendor package (device type ``toyacc``). See ../README.md."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from toy_accel import device as _device

DEVICE_TYPE = "toyacc"
C10D_BACKEND = "toyccl"
IS_CHIPSET_TEST_DOUBLE = True

if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, _device)

    class _Hooks(torch._C._acc.PrivateUse1Hooks):
        """The runtime hooks a vendor registers in C++ (RegisterPrivateUse1HooksInterface);
        torch 2.13 takes them from Python too. torch.distributed's barrier asks them."""

        def is_available(self) -> bool:
            return _device.is_available()

        def has_primary_context(self, device_index: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    _HOOKS = _Hooks()  # kept alive: torch holds a borrowed reference
    torch._C._acc.register_python_privateuseone_hook(_HOOKS)
sys.modules.setdefault(f"torch.{DEVICE_TYPE}", _device)

if dist.is_available() and C10D_BACKEND not in dist.Backend.backend_list:
    def _create(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    # "cpu" too: the double's tensors are host tensors (placement on the host, below).
    dist.Backend.register_backend(C10D_BACKEND, _create, devices=[DEVICE_TYPE, "cpu"])

# Placement on the host: stock torch has no toyacc kernels (see ../README.md).
try:
    import chipset_accelerator.device as _chipset_device
except ImportError:  # an interpreter without chipset: nothing to place
    _chipset_device = None
if _chipset_device is not None:
    _chipset_device.AcceleratorDevice.device_type = "cpu"
