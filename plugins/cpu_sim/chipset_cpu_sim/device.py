"""Simulated devices: count and visibility from the environment, properties from a profile.

Every simulated device computes on the host CPU, so tensors have torch device type
``"cpu"``. Each device owns an RNG state; making a device current swaps its state into
the host generator, so seeding device 0 never disturbs device 1.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence

import torch

from chipset.errors import ConfigError
from chipset.interfaces import Device, DeviceProperties, Event, Stream
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


class SimEvent(Event):
    """A host timestamp. Host work runs eagerly in program order, so a recorded event is complete."""

    def __init__(self, enable_timing: bool = False):
        super().__init__(enable_timing)
        self._t: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter_ns()

    def wait(self, stream: Stream | None = None) -> None:
        pass  # everything recorded before this call has already run

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


class SimStream(Stream):
    """A queue whose work runs eagerly on the host at enqueue time.

    Program order on one host thread is a valid schedule for every ordering a device
    stream promises (work after ``wait_event``/``wait_stream`` runs after what it
    waits for), so a stream is always complete and ``synchronize`` returns at once.
    """

    def __init__(self, device: SimDevice, index: int):
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
        event = event or SimEvent()
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        prev = self._device._streams.get(self.index)
        self._device._streams[self.index] = self
        try:
            yield self
        finally:
            if prev is None:
                self._device._streams.pop(self.index, None)
            else:
                self._device._streams[self.index] = prev


class SimDevice(Device):
    backend_name = "cpu_sim"
    device_type = "cpu"
    visible_devices_env = VISIBLE_ENV

    def __init__(self) -> None:
        self._visible = visible_indices()
        self._profile = profile()
        self._current = 0
        self._rng: dict[int, torch.Tensor] = {}
        self._listeners: list = []
        self._default_streams: dict[int, SimStream] = {}
        self._streams: dict[int, SimStream] = {}

    def device_count(self) -> int:
        return len(self._visible)

    @property
    def profile(self) -> SimProfile:
        return self._profile

    def on_set_device(self, fn) -> None:
        """Call ``fn(index)`` whenever a device becomes current (memory accounting hooks in here)."""
        self._listeners.append(fn)

    def _set_device(self, index: int) -> None:
        if index != self._current:
            self._rng[self._current] = torch.default_generator.get_state()
            if index in self._rng:
                torch.default_generator.set_state(self._rng.pop(index))
        self._current = index
        for fn in self._listeners:
            fn(index)

    def _current_device(self) -> int:
        return self._current

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def _synchronize(self, index: int) -> None:
        pass

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

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        return (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)

    # RNG: the current device's state lives in the host generator.
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        g = torch.Generator().manual_seed(int(seed))
        state = g.get_state()
        for i in range(self.device_count()):
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
        return SimStream(self, self._current)

    def current_stream(self) -> Stream:
        i = self._current
        if i in self._streams:
            return self._streams[i]
        return self._default_streams.setdefault(i, SimStream(self, i))

    def event(self, enable_timing: bool = False) -> Event:
        return SimEvent(enable_timing)
