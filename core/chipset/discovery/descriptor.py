"""The backend descriptor: what an entry point in ``chipset.backends`` points at.

A descriptor is cheap to import: creating one imports no vendor SDK, ``probe()`` never
initialises a device (it must stay fork-safe), and only ``load()`` imports the heavy
implementation module, returning the backend's spec (``chipset.discovery.spec``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chipset.interfaces.device import DeviceProperties
from dataclasses import dataclass, field

__all__ = ["BackendDescriptor"]


@dataclass(frozen=True)
class BackendDescriptor:
    """Describe one backend to chipset's discovery."""

    name: str
    """Backend name users select with CHIPSET_BACKEND (e.g. ``"cuda"``)."""
    api_version: tuple[int, int]
    """The chipset plugin API (major, minor) this plugin was built against."""
    priority: int
    """Higher wins when CHIPSET_BACKEND is unset; simulators are only used without hardware."""
    probe: Callable[[], tuple[bool, str]]
    """Return (available, reason) without initialising any device."""
    load: Callable[[], object]
    """Import the implementation and return its :class:`chipset.discovery.spec.BackendSpec`
    (deprecated: an object carrying ``@chipset.hookimpl`` functions, see ``discovery.legacy``)."""
    simulator: bool = False
    """True for backends that simulate hardware; they never win over real hardware."""
    description: str = ""
    kernels: tuple[str, ...] = field(default=())
    """Kernel names the backend implements, known without loading it (for error messages)."""
    profiles: Callable[[], Mapping[str, DeviceProperties]] | None = None
    """Named device profiles (e.g. ``"h100-sxm"``) readable without the hardware: pure data
    for the planner and the simulator's projection. Must not import a vendor SDK."""
    device_initialized: Callable[[], bool] | None = None
    """Optional: True when this process has initialised the backend's device (driver/runtime
    context created). The conformance suite calls it right after ``probe()`` in a fresh
    process to prove the probe is fork-safe. Must not itself initialise anything."""
    device_types: tuple[str, ...] = ()
    """The torch device types this backend drives (``("cuda",)``, ``("npu",)``, ``("cpu",)``);
    ``"*"``: whatever accelerator the torch build reports. ``chipset backends`` uses it to say
    which installed backends could serve the installed torch build. Empty: not stated."""
    compile_backend: str | None = None
    """The ``torch.compile`` backend (e.g. ``"inductor"``) that ``train.compile = true`` uses on
    this backend's devices; None = compilation unsupported, and such runs are refused before
    launch. A simulator whose accounting must see every eager op declares None."""
