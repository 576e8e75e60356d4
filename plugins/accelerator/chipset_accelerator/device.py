"""A chipset Device over a torch device module (``torch.xpu``, ``torch.cuda``, a vendor's
PrivateUse1 module): devices and RNG by delegation, nothing vendor-specific. Streams and
events are the Device defaults (:mod:`chipset.interfaces.streams`) over the same module:
its own where it has complete ones, else the serial default.

Every call goes to ``self.module`` (the ``torch.<type>`` module), resolved through
``torch.get_device_module`` unless a subclass or a test hands one in. Vendor plugins
subclass :class:`AcceleratorDevice` and keep only their differences (properties tables,
dtypes, error hints).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from chipset.errors import BackendUnavailableError, ConfigError
from chipset.interfaces import Device, DeviceProperties
from chipset.interfaces.streams import has_torch_streams


class AcceleratorDevice(Device):
    """The devices of one torch device type. ``device_type`` is where tensors live (a test
    double may place them on the host); ``accelerator_type`` names the torch module."""

    backend_name = "accelerator"
    visible_devices_env = "CHIPSET_ACCELERATOR_VISIBLE_DEVICES"
    """Read by torch for no device type: each runtime has its own (ZE_AFFINITY_MASK on XPU,
    HIP/CUDA_VISIBLE_DEVICES on ROCm); device_count() honours this one on top, so a launcher
    can narrow any accelerator the same way."""

    def __init__(self, accelerator_type: str | None = None, module=None) -> None:
        if accelerator_type is None:
            from chipset_accelerator import accelerator_type as current

            accelerator_type = current()
            if accelerator_type is None:
                raise BackendUnavailableError(
                    "accelerator: this torch build reports no accelerator (torch.accelerator.current_accelerator() "
                    "is None); install the torch build for your device or choose another backend with CHIPSET_BACKEND."
                )
        self.accelerator_type = accelerator_type
        if "device_type" not in vars(type(self)) and "device_type" not in vars(self):
            self.device_type = accelerator_type
        self._explicit_module = module

    @property
    def module(self):
        """The ``torch.<type>`` module every call goes to (looked up at call time)."""
        if self._explicit_module is not None:
            return self._explicit_module
        return torch.get_device_module(self.accelerator_type)

    def _visible(self) -> list[int] | None:
        """Physical indices left by CHIPSET_ACCELERATOR_VISIBLE_DEVICES, or None (all)."""
        raw = os.environ.get(AcceleratorDevice.visible_devices_env)
        if raw is None or self.visible_devices_env != AcceleratorDevice.visible_devices_env:
            return None
        n = int(self.module.device_count())
        ids = [x.strip() for x in raw.split(",") if x.strip()]
        if not all(x.isdigit() and int(x) < n for x in ids):
            raise ConfigError(f"{self.visible_devices_env}={raw!r}: expected comma-separated device indices "
                              f"below {n} (the {self.accelerator_type} devices torch sees); unset it to use all")
        return [int(x) for x in ids]

    def _phys(self, index: int) -> int:
        """The torch index of visible device ``index``."""
        ids = self._visible()
        return index if ids is None else ids[index]

    def device_count(self) -> int:
        ids = self._visible()
        return int(self.module.device_count()) if ids is None else len(ids)

    # --- primitives ------------------------------------------------------------
    def _set_device(self, index: int) -> None:
        self.module.set_device(self._phys(index))

    def _current_device(self) -> int:
        current = int(self.module.current_device())
        ids = self._visible()
        return current if ids is None or current not in ids else ids.index(current)

    def _torch_device(self, index: int) -> torch.device:
        return torch.device(self.device_type, self._phys(index))

    def _synchronize(self, index: int) -> None:
        self.module.synchronize(self._phys(index))

    def _properties(self, index: int) -> DeviceProperties:
        from chipset_accelerator.properties import describe

        return describe(self.accelerator_type, self.module, self._phys(index), index)

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if self.bf16_supported():
            dtypes.append(torch.bfloat16)
        return (*dtypes, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)

    def bf16_supported(self) -> bool:
        """The device module's answer where it has ``is_bf16_supported``; else no."""
        ask = getattr(self.module, "is_bf16_supported", None)
        return bool(ask()) if ask is not None else False

    # --- RNG -------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.module.manual_seed_all(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self.current_device() if index is None else index)
        return self.module.get_rng_state(self._phys(i))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self.current_device() if index is None else index)
        self.module.set_rng_state(state, self._phys(i))

    # --- streams and events ----------------------------------------------------
    def _stream_module(self):
        """The device module (not ``device_type``'s, which a test double may set to the host)."""
        return self.module if has_torch_streams(self.module) else None

    def has_streams(self) -> bool:
        """Whether the device module has complete streams and events (Capabilities declare them then)."""
        return self._stream_module() is not None
