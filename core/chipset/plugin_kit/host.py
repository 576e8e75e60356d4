"""Building blocks for a backend whose devices compute on the host CPU.

The shipped ``cpu`` backend and the ``cpu_sim`` simulator both run every kernel eagerly on
the calling thread, so they share one honest model of streams, events and per-device RNG;
a vendor prototyping a backend on the host can start from the same classes.

- Program order on one host thread is a valid schedule for every ordering a device stream
  promises (work after ``wait_event``/``wait_stream`` runs after what it waits for), so a
  stream is always complete and events are host timestamps.
- Every device shares the host's default generator. Each device index owns an RNG state;
  making a device current swaps its state into the host generator, so seeding device 0 never
  disturbs device 1 (the contract every backend keeps).

- Collectives run over gloo, torch.distributed's CPU engine. On torch 2.13 gloo refuses
  ``avg`` of integer tensors; :class:`HostCollective` does it as a sum then a division
  rounding toward zero.

A subclass of :class:`HostDevice` gives ``backend_name``, ``visible_devices_env``,
``device_count()`` and ``_properties(index)``; one of :class:`HostCollective` gives
``backend_name``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from chipset.interfaces import Collective, Device, Event, Stream
from chipset.interfaces.collective import divide_for_avg_

__all__ = ["HOST_DTYPES", "HostCollective", "HostDevice", "HostEvent", "HostStream"]

HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32,
               torch.int64, torch.uint8, torch.bool)
"""What the host computes in (half precisions through torch's CPU kernels)."""


class HostEvent(Event):
    """A host timestamp: everything recorded before ``record`` has already run."""

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


class HostStream(Stream):
    """A queue whose work runs eagerly on the host at enqueue time: always complete."""

    def __init__(self, device: HostDevice, index: int):
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
        event = event or self._device.event()
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


class HostDevice(Device):
    """Devices that are the host CPU: eager streams, host-timestamp events, an RNG state per index."""

    device_type = "cpu"
    stream_class: type[HostStream] = HostStream
    event_class: type[HostEvent] = HostEvent

    def __init__(self) -> None:
        self._current = 0
        self._rng: dict[int, torch.Tensor] = {}
        self._listeners: list[Callable[[int], None]] = []
        self._release_listeners: list[Callable[[], None]] = []
        self._streams: dict[int, HostStream] = {}
        self._default_streams: dict[int, HostStream] = {}

    def on_set_device(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(index)`` whenever a device becomes current (per-device memory accounting hooks in here)."""
        self._listeners.append(fn)

    def on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the process releases its device (:meth:`Device.release`)."""
        self._release_listeners.append(fn)

    def release(self) -> None:
        for fn in self._release_listeners:
            fn()

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

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        return HOST_DTYPES

    # RNG: the current device's state lives in the host generator, the others' in self._rng.
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        state = torch.Generator().manual_seed(int(seed)).get_state()
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
        return self.stream_class(self, self._current)

    def current_stream(self) -> Stream:
        i = self._current
        if i in self._streams:
            return self._streams[i]
        return self._default_streams.setdefault(i, self.stream_class(self, i))

    def event(self, enable_timing: bool = False) -> Event:
        return self.event_class(enable_timing)


def _integer_avg(tensor: torch.Tensor, op: str) -> bool:
    return op == "avg" and not (tensor.is_floating_point() or tensor.is_complex())


class HostCollective(Collective):
    """Collectives over gloo, with the integer ``avg`` gloo lacks done as a sum then a division."""

    c10d_backend = "gloo"

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if not _integer_avg(tensor, op):
            return super().all_reduce(tensor, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().all_reduce(tensor, "sum", group, async_op),
                                 lambda: divide_for_avg_(tensor, n))

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if not _integer_avg(input, op):
            return super().reduce_scatter(output, input, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().reduce_scatter(output, input, "sum", group, async_op),
                                 lambda: divide_for_avg_(output, n))
