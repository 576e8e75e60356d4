"""The interfaces a backend implements: Device, Memory, Collective, Capabilities."""

from chipset.interfaces.capabilities import ALL_COLLECTIVES, Capabilities
from chipset.interfaces.collective import Collective, CommStats, Group, Handle, OpCounter, P2POp
from chipset.interfaces.device import Device, DeviceProperties, Event, Stream, dtype_name
from chipset.interfaces.memory import Memory, MemoryStats

__all__ = [
    "ALL_COLLECTIVES",
    "Capabilities",
    "Collective",
    "CommStats",
    "Device",
    "DeviceProperties",
    "Event",
    "Group",
    "Handle",
    "Memory",
    "MemoryStats",
    "OpCounter",
    "P2POp",
    "Stream",
    "dtype_name",
]
