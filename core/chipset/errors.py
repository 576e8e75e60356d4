"""The error types every chipset backend speaks.

Each error carries an ``exit_code`` the CLI uses: 2 for usage and configuration
errors (the user can fix the command line or environment), 1 for everything else.
"""

from __future__ import annotations

__all__ = [
    "ChipsetError",
    "UsageError",
    "ConfigError",
    "BackendSelectionError",
    "BackendUnavailableError",
    "PluginValidationError",
    "IncompatibleAPIError",
    "OutOfMemoryError",
    "CollectiveTimeoutError",
    "CollectiveError",
    "KernelNotFoundError",
    "UnsupportedDTypeError",
    "DeviceIndexError",
]


class ChipsetError(Exception):
    """Base of every error chipset raises on purpose."""

    exit_code = 1


class UsageError(ChipsetError):
    """The command line, environment or config asked for something impossible."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


class BackendSelectionError(UsageError):
    """No backend could be selected under the current ``CHIPSET_BACKEND`` rules."""


class BackendUnavailableError(BackendSelectionError):
    """The requested backend is installed but cannot run here (the reason says why)."""


class PluginValidationError(ChipsetError):
    """A plugin's descriptor or hooks do not match chipset's contract."""


class IncompatibleAPIError(PluginValidationError):
    """A plugin was built against a plugin API this core cannot serve."""


class OutOfMemoryError(ChipsetError, RuntimeError):
    """A device ran out of memory.

    The message always contains ``Tried to allocate N bytes`` (when the size is known)
    and the device, whatever backend raised it.
    """

    def __init__(self, message: str, *, device: str = "", requested_bytes: int | None = None):
        super().__init__(message)
        self.device = device
        self.requested_bytes = requested_bytes


class CollectiveError(ChipsetError, RuntimeError):
    """A collective operation failed (a peer died, the transport broke)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the configured timeout.

    Raised instead of hanging forever; the message names the operation, the group and
    the timeout.
    """


class KernelNotFoundError(ChipsetError, LookupError):
    """No implementation of a named kernel is registered for the selected backend."""


class UnsupportedDTypeError(ChipsetError, TypeError):
    """A dtype the backend does not declare was requested."""


class DeviceIndexError(ChipsetError, IndexError):
    """A device index outside ``0 .. device_count()-1`` was requested."""
