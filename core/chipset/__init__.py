"""chipset: one training stack, any chip.

The public surface is listed in ``__all__``; everything else is private.
"""

import os as _os

# torch >= 2.5 imports every installed accelerator extension (entry point group
# "torch.backends") on ``import torch`` unless TORCH_DEVICE_BACKEND_AUTOLOAD=0. That would
# load a vendor runtime in every process that merely imports chipset, before any probe
# runs, breaking the promise that discovery and probes import no vendor SDK. chipset's
# plugins import their runtime themselves, in ``load()``. Set before torch is first
# imported (a user's explicit setting wins); child processes inherit it.
_os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from chipset._version import API_VERSION, __version__  # noqa: E402
from chipset.errors import (  # noqa: E402
    BackendSelectionError,
    BackendUnavailableError,
    ChipsetError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    DeviceIndexError,
    IncompatibleAPIError,
    KernelNotFoundError,
    OutOfMemoryError,
    PluginValidationError,
    UnsupportedDTypeError,
    UsageError,
)

# The names below import torch (and pluggy) when first used, not when chipset is imported:
# commands that need neither (``chipset --version``, ``plan``, ``report``, ``diagnose``) start
# in a tenth of the time, and a process that imports chipset pays for torch only if it uses it.
_LAZY = {
    "BackendDescriptor": "chipset.discovery", "ChipsetPluginWarning": "chipset.discovery",
    "BackendSpec": "chipset.discovery", "hookimpl": "chipset.discovery",
    "Capabilities": "chipset.interfaces", "DeviceProperties": "chipset.interfaces",
    "MemoryStats": "chipset.interfaces",
    "Backend": "chipset.loader", "backend": "chipset.loader", "list_backends": "chipset.loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'chipset' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "API_VERSION",
    "Backend",
    "BackendDescriptor",
    "BackendSelectionError",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "ChipsetError",
    "ChipsetPluginWarning",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DeviceIndexError",
    "DeviceProperties",
    "IncompatibleAPIError",
    "KernelNotFoundError",
    "MemoryStats",
    "OutOfMemoryError",
    "PluginValidationError",
    "UnsupportedDTypeError",
    "UsageError",
    "__version__",
    "backend",
    "hookimpl",
    "list_backends",
]
