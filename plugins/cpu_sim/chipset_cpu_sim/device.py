"""Simulated devices: count and visibility from the environment, properties from a profile.

Every simulated device computes on the host CPU, so tensors have torch device type
``"cpu"``; per-device RNG states are chipset's shared host-backend device
(:mod:`chipset.plugin_kit.host`), streams and events the Device's serial default
(:mod:`chipset.interfaces.streams`: work runs when issued, events are host timestamps).
What is simulated is the count, the visibility, the properties (a profile) and, in
memory.py, the per-device memory.
"""

from __future__ import annotations

import os

from chipset.errors import ConfigError
from chipset.interfaces import DeviceProperties
from chipset.plugin_kit.host import HostDevice
from chipset_cpu_sim.profiles import DEFAULT_PROFILE, SimProfile, resolve

DEVICES_ENV = "CHIPSET_SIM_DEVICES"
VISIBLE_ENV = "CHIPSET_SIM_VISIBLE_DEVICES"
PROFILE_ENV = "CHIPSET_SIM_PROFILE"
DEFAULT_DEVICES = 8
MAX_DEVICES = 4096
"""Most simulated devices per node: each keeps its own RNG state and memory counters on the host,
so an absurd count (99999999) is refused at once instead of eating gigabytes of bookkeeping."""


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
        if value < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, found {raw!r}") from None
    return value


def physical_count() -> int:
    n = _int_env(DEVICES_ENV, DEFAULT_DEVICES)
    if n > MAX_DEVICES:
        raise ConfigError(f"{DEVICES_ENV}={n}: at most {MAX_DEVICES} simulated devices per node (each keeps an "
                          f"RNG state and memory counters on the host); set {DEVICES_ENV} to {MAX_DEVICES} or fewer")
    return n


def visible_indices() -> list[int]:
    """Physical indices visible to this process, honouring CHIPSET_SIM_VISIBLE_DEVICES."""
    n = physical_count()
    raw = os.environ.get(VISIBLE_ENV)
    if raw is None:
        return list(range(n))
    try:
        idx = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{VISIBLE_ENV} must be comma-separated device indices, found {raw!r}") from None
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise ConfigError(f"{VISIBLE_ENV}={raw!r} names device(s) {bad} but {DEVICES_ENV} gives {n} (0..{n - 1})")
    return idx


def profile() -> SimProfile:
    """The profile named by CHIPSET_SIM_PROFILE (sim profiles, then any backend's declared ones)."""
    name = os.environ.get(PROFILE_ENV, "").strip() or DEFAULT_PROFILE
    return resolve(name)


class SimDevice(HostDevice):
    backend_name = "cpu_sim"
    visible_devices_env = VISIBLE_ENV

    def __init__(self) -> None:
        super().__init__()
        self._visible = visible_indices()
        self._profile = profile()

    def device_count(self) -> int:
        return len(self._visible)

    @property
    def profile(self) -> SimProfile:
        return self._profile

    def _properties(self, index: int) -> DeviceProperties:
        p = self._profile
        return DeviceProperties(
            name=p.name,
            index=index,
            total_memory=p.memory,
            peak_flops=dict(p.peak_flops),
            memory_bandwidth=p.memory_bandwidth,
            intra_node_bandwidth=p.intra_node_bandwidth,
            inter_node_bandwidth=p.inter_node_bandwidth,
            intra_node_latency=p.intra_node_latency,
            inter_node_latency=p.inter_node_latency,
            estimated=True,
            source=f"{p.source or f'cpu_sim profile {p.name!r}'} (simulated, physical device {self._visible[index]})",
        )
