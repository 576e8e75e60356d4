"""The backend spec: one frozen value that says how chipset builds a backend.

A plugin's descriptor (``chipset.discovery.descriptor``) stays the cheap half: discovery
imports it and calls ``probe()``. Its ``load()`` imports the implementation and returns a
:class:`BackendSpec`, from which the loader builds the device first, then memory,
collective and capabilities for that device, then lets the spec register kernels.

Importing this module imports nothing heavy (no torch), so a descriptor module may import
it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chipset.errors import PluginValidationError

if TYPE_CHECKING:
    from chipset.interfaces import Capabilities, Collective, Device, Memory
    from chipset.kernels import KernelRegistry

__all__ = ["BackendSpec"]

_REQUIRED = ("device", "memory", "collective")
_OPTIONAL = ("register_kernels", "launch_env")


@dataclass(frozen=True)
class BackendSpec:
    """Declare one backend: what to build, in the order the loader builds it."""

    name: str
    """The backend's name; must equal the descriptor's (``CHIPSET_BACKEND`` selects it)."""
    device: Callable[[], Device]
    """Called with no argument; returns the :class:`chipset.interfaces.Device` (usually the class)."""
    memory: Callable[[Device], Memory]
    """Called with the device; returns its :class:`chipset.interfaces.Memory`."""
    collective: Callable[[Device], Collective]
    """Called with the device; returns its :class:`chipset.interfaces.Collective`."""
    capabilities: Capabilities | Callable[[Device], Capabilities]
    """A :class:`chipset.interfaces.Capabilities`, or a function of the device returning one
    (when what works depends on the part found, e.g. bfloat16). Declare only what works;
    ``kernels`` is filled in by core from what ``register_kernels`` registered."""
    register_kernels: Callable[[KernelRegistry, Device], Any] | None = None
    """Optional: ``register_kernels(registry, device)`` registers fused kernels on the
    :class:`chipset.kernels.KernelRegistry`; returns nothing."""
    launch_env: Callable[[int, int], Mapping[str, str]] | None = None
    """Optional: ``launch_env(local_rank, local_world_size)`` returns the environment variables
    a launcher sets for one local rank (visible devices, a collective library's switches)."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name must be the backend's name (a non-empty str), found {self.name!r}")
        for field in _REQUIRED:
            if not callable(getattr(self, field)):
                problems.append(f"{field} must be callable (a class or function), found {_kind(getattr(self, field))}")
        for field in _OPTIONAL:
            value = getattr(self, field)
            if value is not None and not callable(value):
                problems.append(f"{field} must be a function or None, found {_kind(value)}")
        if self.capabilities is None:
            problems.append("capabilities must be a chipset.Capabilities or a function of the device, found None")
        # Any other capabilities value that is not a function is checked to be a Capabilities when the
        # backend is built: importing the interfaces here would import torch into descriptors.
        if problems:
            raise PluginValidationError(
                f"BackendSpec {self.name!r} is not valid: " + "; ".join(problems)
                + ". See docs/writing-a-plugin.md §4 The hooks."
            )


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]
