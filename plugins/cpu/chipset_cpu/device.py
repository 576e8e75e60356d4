"""The host CPU as chipset devices.

Ranks of one host share its CPU, so the backend shows a number of device *slots*
(``CHIPSET_CPU_DEVICES``, default the larger of the core count and 8), all of them the
same CPU: ``set_device(local_rank)`` works for every local rank a launcher starts. Each
slot owns an RNG state; making a slot current swaps its state into the host generator,
so seeding slot 0 never disturbs slot 1 (the contract every backend keeps).

Work runs eagerly in program order on the calling thread, so streams are always
complete and events are host timestamps.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator, Sequence

import torch

from chipset.errors import ConfigError
from chipset.interfaces import Device, DeviceProperties, Event, Stream

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


class CpuEvent(Event):
    """A host timestamp: work before ``record`` has already run."""

    def __init__(self, enable_timing: bool = False):
        super().__init__(enable_timing)
        self._t: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter_ns()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Event) -> float:
        if not (self.enable_timing and getattr(end, "enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or getattr(end, "_t", None) is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._t - self._t) / 1e6


class CpuStream(Stream):
    """Eager host execution: every ordering a stream promises holds in program order."""

    def __init__(self, device: CpuDevice, index: int):
        self._device = device
        self.index = index

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Event | None = None) -> Event:
        event = event or CpuEvent()
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        streams = self._device._streams
        prev = streams.get(self.index)
        streams[self.index] = self
        try:
            yield self
        finally:
            if prev is None:
                streams.pop(self.index, None)
            else:
                streams[self.index] = prev


class CpuDevice(Device):
    backend_name = "cpu"
    device_type = "cpu"
    visible_devices_env = DEVICES_ENV

    def __init__(self) -> None:
        self._count = slot_count()
        self._current = 0
        self._rng: dict[int, torch.Tensor] = {}
        self._streams: dict[int, CpuStream] = {}
        self._default_streams: dict[int, CpuStream] = {}

    def device_count(self) -> int:
        return self._count

    def _set_device(self, index: int) -> None:
        if index != self._current:
            self._rng[self._current] = torch.default_generator.get_state()
            if index in self._rng:
                torch.default_generator.set_state(self._rng.pop(index))
        self._current = index

    def _current_device(self) -> int:
        return self._current

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def _synchronize(self, index: int) -> None:
        pass

    def _properties(self, index: int) -> DeviceProperties:
        return DeviceProperties(
            name=cpu_name(),
            index=index,
            total_memory=host_memory()[1],
            estimated=True,
            source=f"host CPU ({os.cpu_count()} cores shared by every slot); no datasheet rates",
        )

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        return (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32,
                torch.int64, torch.uint8, torch.bool)

    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        state = torch.Generator().manual_seed(int(seed)).get_state()
        for i in range(self._count):
            if i != self._current:
                self._rng[i] = state.clone()
        torch.default_generator.manual_seed(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self._current if index is None else index)
        if i == self._current:
            return torch.default_generator.get_state()
        if i not in self._rng:
            self._rng[i] = torch.Generator().get_state()
        return self._rng[i].clone()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self._current if index is None else index)
        if i == self._current:
            torch.default_generator.set_state(state)
        else:
            self._rng[i] = state.clone()

    def stream(self) -> Stream:
        return CpuStream(self, self._current)

    def current_stream(self) -> Stream:
        i = self._current
        if i in self._streams:
            return self._streams[i]
        return self._default_streams.setdefault(i, CpuStream(self, i))

    def event(self, enable_timing: bool = False) -> Event:
        return CpuEvent(enable_timing)
