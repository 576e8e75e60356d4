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
from chipset.discovery import BackendDescriptor, ChipsetPluginWarning, hookimpl
from chipset.errors import (
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
from chipset.interfaces import Capabilities, DeviceProperties, MemoryStats
from chipset.loader import Backend, backend, list_backends

__all__ = [
    "API_VERSION",
    "Backend",
    "BackendDescriptor",
    "BackendSelectionError",
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
