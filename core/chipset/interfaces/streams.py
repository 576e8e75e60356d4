"""Streams and events: the interface, and the two implementations every Device has by default.

A backend need not write streams or events. ``Device.stream``, ``Device.current_stream`` and
``Device.event`` give, without an override:

- **the device module's own**, wrapped in :class:`TorchStream` and :class:`TorchEvent`, where
  the torch device module of the backend (``Device._stream_module``; by default
  ``torch.get_device_module(device_type)``) has complete streams and events
  (:func:`has_torch_streams`): a ``Stream`` class with ``synchronize``, ``query``,
  ``wait_event`` and ``wait_stream``, an ``Event`` class with ``record``, ``wait``,
  ``synchronize``, ``query`` and ``elapsed_time``, and the functions ``current_stream`` and
  ``stream`` (the context manager). ``torch.cpu`` does not qualify: on torch 2.13 its
  ``Stream`` has neither ``synchronize`` nor ``query`` and its ``Event`` takes no
  ``enable_timing`` and has no ``elapsed_time``.
- **the serial default** otherwise, :class:`SerialStream` and :class:`SerialEvent`: the device
  is treated as one queue that runs work in the order the host issues it. Every stream of a
  device index is a view of that queue, so ``wait_event``, ``wait_stream`` and ``Event.wait``
  have nothing to do. Waiting for completion (``synchronize`` and ``query`` of a stream or a
  recorded event) is ``Device.synchronize(index)``: free on a host backend, whose work ran
  when it was issued; a whole-device barrier on an asynchronous device, so ``query`` blocks
  there but never answers True early. An event records a host timestamp
  (``time.perf_counter_ns``); a timing event (``enable_timing=True``) first synchronizes the
  device, so the stamp follows the work issued before it, and ``elapsed_time`` is the
  milliseconds between two stamps. ``Stream.context`` makes the stream current for its
  device index inside the block; outside every context, ``current_stream()`` is one default
  stream per index (the same object on each call).

Both raise ``RuntimeError`` from ``elapsed_time`` when either event lacks
``enable_timing=True`` or was never recorded, as real backends do, and ``TypeError`` when the
events (or an event and a stream) belong to different implementations.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chipset.interfaces.device import Device

__all__ = ["Event", "SerialEvent", "SerialStream", "Stream", "TorchEvent", "TorchStream", "has_torch_streams"]


class Event(ABC):
    """A marker in a stream. ``elapsed_time`` needs two recorded timing events."""

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing

    @abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (default: the current stream)."""

    @abstractmethod
    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait until this event has completed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event has completed."""

    @abstractmethod
    def query(self) -> bool:
        """True when all work captured by the event has completed."""

    @abstractmethod
    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end``.

        Raises ``RuntimeError`` when either event was created without
        ``enable_timing=True`` or has not been recorded, as real backends do.
        """


class Stream(ABC):
    """An ordered queue of device work."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued on the stream has completed."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make future work on this stream wait for ``event``."""

    @abstractmethod
    def wait_stream(self, other: Stream) -> None:
        """Make future work on this stream wait for all work queued on ``other``."""

    @abstractmethod
    def query(self) -> bool:
        """True when all queued work has completed."""

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream and return it."""
        raise NotImplementedError

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        """Make this the current stream inside the block."""
        raise NotImplementedError
        yield self  # pragma: no cover


def _timing_checked(start: Event, end: Event, kind: type) -> None:
    if not isinstance(end, kind):
        raise TypeError(f"elapsed_time needs an event of the same kind ({kind.__name__}), found {type(end).__name__}")
    if not (start.enable_timing and end.enable_timing):
        raise RuntimeError("elapsed_time needs both events created with enable_timing=True")


# --- the serial default ------------------------------------------------------------------
class _Streams:
    """A device's stream bookkeeping: the serial streams made current by ``context`` and the
    default one per index; one wrapper per torch stream (module doc)."""

    def __init__(self) -> None:
        self.current: dict[int, SerialStream] = {}
        self.default: dict[int, SerialStream] = {}
        self.wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def bookkeeping(device: Device) -> _Streams:
    """The stream bookkeeping of ``device``, made on first use (a Device has no ``__init__``
    a backend must call)."""
    state = vars(device).get("_chipset_streams")
    if state is None:
        state = device._chipset_streams = _Streams()
    return state


class SerialEvent(Event):
    """A host timestamp on the device's one queue (module doc)."""

    def __init__(self, device: Device, enable_timing: bool = False):
        super().__init__(enable_timing)
        self._device = device
        self._index: int | None = None
        self._t: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        index = stream.index if isinstance(stream, SerialStream) else self._device.current_device()
        if self.enable_timing:
            self._device.synchronize(index)
        self._index, self._t = index, time.perf_counter_ns()

    def wait(self, stream: Stream | None = None) -> None:
        pass  # one queue: what a stream issues next already runs after this event's work

    def synchronize(self) -> None:
        if self._index is not None:
            self._device.synchronize(self._index)

    def query(self) -> bool:
        self.synchronize()
        return True

    def elapsed_time(self, end: Event) -> float:
        _timing_checked(self, end, SerialEvent)
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded (call record() on each first)")
        return (end._t - self._t) / 1e6


class SerialStream(Stream):
    """A view of device ``index``'s one queue (module doc)."""

    def __init__(self, device: Device, index: int):
        self._device = device
        self.index = index

    def synchronize(self) -> None:
        self._device.synchronize(self.index)

    def wait_event(self, event: Event) -> None:
        pass  # one queue: already ordered

    def wait_stream(self, other: Stream) -> None:
        pass

    def query(self) -> bool:
        self.synchronize()
        return True

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else self._device.event()
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        current = bookkeeping(self._device).current
        prev = current.get(self.index)
        current[self.index] = self
        try:
            yield self
        finally:
            if prev is None:
                current.pop(self.index, None)
            else:
                current[self.index] = prev


def serial_current(device: Device) -> SerialStream:
    """The serial stream current on ``device``'s current index: the one a ``context`` made
    current, else the index's default stream."""
    i = device.current_device()
    state = bookkeeping(device)
    if i in state.current:
        return state.current[i]
    if i not in state.default:
        state.default[i] = SerialStream(device, i)
    return state.default[i]


# --- a torch device module's streams and events ------------------------------------------
_MODULE_NAMES = ("Stream", "Event", "current_stream", "stream")
_STREAM_METHODS = ("synchronize", "query", "wait_event", "wait_stream")
_EVENT_METHODS = ("record", "wait", "synchronize", "query", "elapsed_time")


def has_torch_streams(module) -> bool:
    """Whether the torch device module ``module`` has complete streams and events (module doc)."""
    if module is None or not all(hasattr(module, n) for n in _MODULE_NAMES):
        return False
    return (all(hasattr(module.Stream, m) for m in _STREAM_METHODS)
            and all(hasattr(module.Event, m) for m in _EVENT_METHODS))


def _raw(stream: Stream | None):
    if stream is None:
        return None
    if not isinstance(stream, TorchStream):
        raise TypeError(f"expected a stream of the same device module (TorchStream), found {type(stream).__name__}")
    return stream.torch_stream


def _key(raw):
    try:
        hash(raw)
        return raw
    except TypeError:  # a stream type without __hash__: identity is all there is
        return id(raw)


class TorchEvent(Event):
    """An event of a torch device module (``module.Event``)."""

    def __init__(self, module, enable_timing: bool = False):
        super().__init__(enable_timing)
        self.torch_event = module.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self.torch_event.record(_raw(stream))

    def wait(self, stream: Stream | None = None) -> None:
        self.torch_event.wait(_raw(stream))

    def synchronize(self) -> None:
        self.torch_event.synchronize()

    def query(self) -> bool:
        return bool(self.torch_event.query())

    def elapsed_time(self, end: Event) -> float:
        _timing_checked(self, end, TorchEvent)
        # The interface asks for RuntimeError; some device modules raise ValueError for an
        # unrecorded event (torch 2.11's did), others RuntimeError.
        try:
            return float(self.torch_event.elapsed_time(end.torch_event))
        except ValueError as exc:
            raise RuntimeError(f"elapsed_time: {exc}") from exc


class TorchStream(Stream):
    """A stream of a torch device module. Device modules hand out a new Python object per
    ``current_stream()`` call; two wrappers are the same stream when the torch streams compare
    equal, and :func:`wrap` keeps one wrapper per torch stream, so ``current_stream()`` inside
    ``s.context()`` is ``s``."""

    def __init__(self, module, torch_stream):
        self._module = module
        self.torch_stream = torch_stream

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchStream) and self.torch_stream == other.torch_stream

    def __hash__(self) -> int:
        return hash(_key(self.torch_stream))

    def synchronize(self) -> None:
        self.torch_stream.synchronize()

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, TorchEvent):
            raise TypeError(f"wait_event needs an event of the same device module (TorchEvent), found {type(event).__name__}")
        self.torch_stream.wait_event(event.torch_event)

    def wait_stream(self, other: Stream) -> None:
        self.torch_stream.wait_stream(_raw(other))

    def query(self) -> bool:
        return bool(self.torch_stream.query())

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else TorchEvent(self._module)
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        with self._module.stream(self.torch_stream):
            yield self


def wrap(device: Device, module, raw) -> TorchStream:
    """The one wrapper of torch stream ``raw`` on ``device``."""
    wrappers = bookkeeping(device).wrappers
    key = _key(raw)
    w = wrappers.get(key)
    if w is None:
        w = wrappers[key] = TorchStream(module, raw)
    return w
