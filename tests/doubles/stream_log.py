"""TEST DOUBLE of a Device whose streams run asynchronously, for activation offload's side-stream
path on a machine without one (tests/runtime/test_offload_streams.py).

``StreamLogDevice`` is chipset's host device (plugin_kit/host.py: work runs eagerly on the host)
whose streams and events (the serial default's, interfaces/streams.py) append every call to ``log``: ``("wait_event", stream, event)``,
``("wait_stream", stream, other)``, ``("record", stream, event)``, ``("complete", event)``.
Streams and events are named (``"compute"``, ``"side1"``, ``"e1"``...). An event completes only
at its second ``query`` (or at ``synchronize``, its own or the device's), as a copy still running on a real device would:
a caller that drops what the copy reads at the first query is caught. Nothing here is a device:
it proves the order in which chipset asks for the work, not that a device honours it.
"""

from __future__ import annotations

import contextlib
import itertools

from chipset.interfaces import DeviceProperties
from chipset.interfaces.streams import SerialEvent, SerialStream
from chipset.plugin_kit.host import HostDevice


class LoggedEvent(SerialEvent):
    def __init__(self, device: StreamLogDevice, enable_timing: bool = False):
        super().__init__(device, enable_timing)
        self.name = f"e{next(device.counter)}"
        device.events.append(self)
        self.log = device.log
        self.queries = 0
        self.done = False

    def _complete(self) -> None:
        if not self.done:
            self.done = True
            self.log.append(("complete", self.name))

    def record(self, stream=None) -> None:
        super().record(stream)
        self.log.append(("record", stream.name, self.name))

    def wait(self, stream=None) -> None:
        stream.wait_event(self)

    def synchronize(self) -> None:
        self._complete()

    def query(self) -> bool:
        self.queries += 1
        if self.queries >= 2:
            self._complete()
        return self.done


class LoggedStream(SerialStream):
    def __init__(self, device: StreamLogDevice, index: int, name: str):
        super().__init__(device, index)
        self.name = name

    def wait_event(self, event) -> None:
        self._device.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other) -> None:
        self._device.log.append(("wait_stream", self.name, other.name))

    @contextlib.contextmanager
    def context(self):
        prev, self._device.current = self._device.current, self
        try:
            yield self
        finally:
            self._device.current = prev


class StreamLogDevice(HostDevice):
    """One host device whose streams and events log their calls (module doc)."""

    backend_name = "stream-log-double"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.counter = itertools.count(1)
        self.events: list[LoggedEvent] = []
        self.current = LoggedStream(self, 0, "compute")

    def device_count(self) -> int:
        return 1

    def _properties(self, index: int) -> DeviceProperties:
        return DeviceProperties(name="stream-log-double", index=index, total_memory=2**30)

    def _synchronize(self, index: int) -> None:
        for event in self.events:  # the device has finished everything queued
            event.synchronize()

    def current_stream(self) -> LoggedStream:
        return self.current

    def stream(self) -> LoggedStream:
        return LoggedStream(self, 0, f"side{next(self.counter)}")

    def event(self, enable_timing: bool = False) -> LoggedEvent:
        return LoggedEvent(self, enable_timing)
