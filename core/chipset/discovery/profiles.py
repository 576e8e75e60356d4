"""Named device profiles gathered from every installed backend, without any hardware.

A profile is a :class:`chipset.DeviceProperties` under a name (``"h100-sxm"``,
``"910b"``, ``"sim-generic"``). The planner and the simulator's projection read them
on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping

from chipset.discovery.records import discover
from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties

__all__ = ["all_profiles", "get_profile"]


def all_profiles() -> dict[str, tuple[str, DeviceProperties]]:
    """name -> (backend that declares it, properties), over every importable backend."""
    out: dict[str, tuple[str, DeviceProperties]] = {}
    for rec in discover():
        desc = rec.descriptor
        if desc is None or desc.profiles is None:
            continue
        table: Mapping[str, DeviceProperties] = desc.profiles()
        for name, props in table.items():
            out.setdefault(name, (rec.name, props))
    return out


def get_profile(name: str) -> DeviceProperties:
    """The profile called ``name``; ConfigError listing the known names otherwise."""
    profiles = all_profiles()
    try:
        return profiles[name][1]
    except KeyError:
        known = ", ".join(sorted(profiles)) or "(none)"
        raise ConfigError(f"unknown device profile {name!r}; known profiles: {known}") from None
