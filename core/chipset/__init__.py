"""chipset: one training stack, any chip.

The public surface is listed in ``__all__``; everything else is private.
"""

from chipset._version import API_VERSION, __version__
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
