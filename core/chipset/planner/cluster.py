"""The cluster: ``NODESxDEVICES:PROFILE``, resolved against every installed plugin's profiles."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from chipset.discovery.profiles import all_profiles
from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties

__all__ = ["Cluster", "parse_cluster_spec", "resolve_cluster", "list_profiles"]

_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*:\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*$")


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of identical devices."""

    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices in each node (one rank per device)."""
    device: DeviceProperties
    """Properties of every device, with any bandwidth overrides applied."""
    profile: str = ""
    """The profile name the properties came from."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


MAX_DEVICES = 2**20
"""Most devices a cluster spec may name: the search walks every divisor of the world size, so an absurd
spec (10^9 x 10^9) would run for ever instead of answering."""


def parse_cluster_spec(spec: str) -> tuple[int, int, str]:
    """``"64x8:a100-80g"`` -> ``(64, 8, "a100-80g")``; ConfigError when it does not parse."""
    mt = _SPEC.match(spec or "")
    if not mt or int(mt.group(1)) < 1 or int(mt.group(2)) < 1:
        raise ConfigError(
            f"cannot parse cluster spec {spec!r}: expected NODESxDEVICES:PROFILE with positive integers, "
            "for example 64x8:a100-80g (run 'chipset plan --list-profiles' for profile names)"
        )
    nodes, per_node = int(mt.group(1)), int(mt.group(2))
    if nodes * per_node > MAX_DEVICES:
        raise ConfigError(
            f"cluster spec {spec!r} has {nodes * per_node:,} devices; the planner enumerates layouts of at most "
            f"{MAX_DEVICES:,} devices (the largest training clusters hold ~10^5); give fewer NODES or DEVICES"
        )
    return nodes, per_node, mt.group(3)


def list_profiles() -> dict[str, tuple[str, DeviceProperties]]:
    """name -> (declaring backend, properties) over every installed backend."""
    return all_profiles()


def resolve_cluster(spec: str, intra_node_bw_gbps: float | None = None,
                    inter_node_bw_gbps: float | None = None,
                    profiles: dict[str, tuple[str, DeviceProperties]] | None = None) -> Cluster:
    """Parse ``spec`` and look its profile up; bandwidth overrides are in GB/s (1e9 bytes/s)."""
    nodes, per_node, name = parse_cluster_spec(spec)
    table = list_profiles() if profiles is None else profiles
    if name not in table:
        known = ", ".join(sorted(table)) or "(none: install a chipset backend that declares profiles)"
        raise ConfigError(f"unknown device profile {name!r} in cluster spec {spec!r}; known profiles: {known}")
    props = table[name][1]
    changes = {}
    for key, value in (("intra_node_bandwidth", intra_node_bw_gbps), ("inter_node_bandwidth", inter_node_bw_gbps)):
        if value is not None:
            if value <= 0:
                raise ConfigError(f"--{key.replace('_bandwidth', '-bw').replace('_', '-')} must be positive GB/s (found {value})")
            changes[key] = value * 1e9
    if changes:
        props = dataclasses.replace(props, **changes)
    return Cluster(nodes=nodes, devices_per_node=per_node, device=props, profile=name)
