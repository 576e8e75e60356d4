"""The host CPU as chipset devices.

Ranks of one host share its CPU, so the backend shows a number of device *slots*
(``CHIPSET_CPU_DEVICES``, default the larger of the core count and 8), all of them the
same CPU: ``set_device(local_rank)`` works for every local rank a launcher starts. Each
slot owns an RNG state; making a slot current swaps its state into the host generator,
so seeding slot 0 never disturbs slot 1 (the contract every backend keeps).

Work runs eagerly in program order on the calling thread, so streams are always
complete and events are host timestamps: the Device's serial default
(:mod:`chipset.interfaces.streams`), kept by the shared host-backend device of
:mod:`chipset.plugin_kit.host`.

Selecting a device also tunes glibc's malloc for training, once per process
(:mod:`chipset_cpu.malloc`; ``CHIPSET_CPU_MALLOC=system`` leaves it alone).
"""

from __future__ import annotations

import os
import platform

from chipset.errors import ConfigError
from chipset.interfaces import DeviceProperties
from chipset.plugin_kit.host import HostDevice
from chipset_cpu.malloc import keep_freed_memory

DEVICES_ENV = "CHIPSET_CPU_DEVICES"


def slot_count() -> int:
    raw = os.environ.get(DEVICES_ENV, "").strip()
    if not raw:
        return max(8, os.cpu_count() or 1)
    try:
        n = int(raw)
        if n < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{DEVICES_ENV} must be a positive integer (device slots on this host), found {raw!r}") from None
    return n


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo where there is one."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "host CPU"


class CpuDevice(HostDevice):
    backend_name = "cpu"
    visible_devices_env = DEVICES_ENV

    def __init__(self) -> None:
        super().__init__()
        self._count = slot_count()

    def device_count(self) -> int:
        return self._count

    def _set_device(self, index: int) -> None:
        # A rank selects its device before it builds a model: from here on the process keeps
        # the memory a step frees for the next step (chipset_cpu/malloc.py; once per process).
        keep_freed_memory()
        super()._set_device(index)

    def _properties(self, index: int) -> DeviceProperties:
        return DeviceProperties(
            name=cpu_name(),
            index=index,
            total_memory=host_memory()[1],
            estimated=True,
            source=f"host CPU ({os.cpu_count()} cores shared by every slot); no datasheet rates",
        )
