"""Streams and events are optional in the backend contract (chipset/interfaces/streams.py): a
Device that writes none gets the serial default, or its torch device module's own where that
module has complete ones. Checked on a minimal Device, on the fake torch.cuda TEST DOUBLE
(tests/doubles/fake_cuda.py) and, in a fresh interpreter, on the PrivateUse1 TEST DOUBLE that
torch.get_device_module reaches (tests/doubles/privateuse1_double).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from doubles.fake_cuda import FakeCuda

import testenv
from chipset.interfaces import Device, DeviceProperties, Event, Stream
from chipset.interfaces.streams import (
    SerialEvent,
    SerialStream,
    TorchEvent,
    TorchStream,
    has_torch_streams,
)

DOUBLE = Path(__file__).parents[1] / "doubles" / "privateuse1_double"


class Bare(Device):
    """Two host devices and nothing about streams or events; counts each synchronize per index."""

    backend_name, device_type = "bare", "cpu"
    supported_dtypes = (torch.float32,)

    def __init__(self) -> None:
        self.current, self.synced = 0, []

    def device_count(self) -> int:
        return 2

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_rng_state(self, index=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state, index=None) -> None:
        torch.set_rng_state(state)

    def _set_device(self, index: int) -> None:
        self.current = index

    def _current_device(self) -> int:
        return self.current

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def _synchronize(self, index: int) -> None:
        self.synced.append(index)

    def _properties(self, index: int) -> DeviceProperties:
        return DeviceProperties(name="bare", index=index, total_memory=2**30)


class OverFakeCuda(Bare):
    """Bare whose streams and events come from a device module found its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.module = FakeCuda()

    def _stream_module(self):
        return self.module


def test_torch_cpu_streams_are_incomplete_so_a_cpu_device_gets_the_serial_default():
    # torch 2.13: torch.cpu.Stream has no synchronize or query, torch.cpu.Event no elapsed_time
    # (and takes no enable_timing); wrapping them would break the contract.
    assert hasattr(torch.cpu, "Stream") and hasattr(torch.cpu, "current_stream")
    assert not hasattr(torch.cpu.Stream, "synchronize") and not hasattr(torch.cpu.Event, "elapsed_time")
    assert not has_torch_streams(torch.cpu)
    dev = Bare()
    assert dev._stream_module() is None
    assert type(dev.stream()) is SerialStream and type(dev.event()) is SerialEvent


def test_serial_streams_complete_through_the_device_synchronize_of_their_index():
    dev = Bare()
    dev.set_device(1)
    s = dev.stream()
    assert isinstance(s, Stream) and s.index == 1 and s is not dev.stream()
    s.synchronize()
    assert s.query() is True
    assert dev.synced == [1, 1]
    s.wait_event(dev.event())  # one queue: nothing to wait for, nothing synchronized
    s.wait_stream(dev.current_stream())
    assert dev.synced == [1, 1]


def test_serial_current_stream_is_one_per_index_and_context_makes_a_stream_current():
    dev = Bare()
    default0 = dev.current_stream()
    assert dev.current_stream() is default0
    a, b = dev.stream(), dev.stream()
    with a.context():
        assert dev.current_stream() is a
        with b.context():
            assert dev.current_stream() is b
        assert dev.current_stream() is a
        dev.set_device(1)  # another index has its own current stream
        assert dev.current_stream() is not a and dev.current_stream().index == 1
        dev.set_device(0)
    assert dev.current_stream() is default0


def test_serial_events_record_host_time_and_only_timing_events_synchronize_to_record():
    dev = Bare()
    plain = dev.event()
    assert isinstance(plain, Event) and plain.query() is True and dev.synced == []  # unrecorded: nothing to wait for
    plain.record()
    assert dev.synced == []
    start, end = dev.event(enable_timing=True), dev.event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record(dev.stream())
    assert dev.synced == [0, 0]  # each timing record waits for the work before it
    assert start.elapsed_time(end) >= 20.0  # sleep() lasts at least what it is asked
    assert dev.current_stream().record_event() is not None


def test_serial_elapsed_time_errors_are_the_contracts():
    dev = Bare()
    a, b = dev.event(), dev.event()
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        a.elapsed_time(b)
    t, u = dev.event(enable_timing=True), dev.event(enable_timing=True)
    t.record()
    with pytest.raises(RuntimeError, match="recorded"):
        t.elapsed_time(u)
    with pytest.raises(TypeError, match="SerialEvent"):
        t.elapsed_time(TorchEvent(FakeCuda(), enable_timing=True))


def test_a_module_with_streams_is_wrapped_one_wrapper_per_stream():
    dev = OverFakeCuda()
    s = dev.stream()
    assert type(s) is TorchStream and s.torch_stream.stream_id != dev.module._current_stream.stream_id
    before = dev.current_stream()
    assert dev.current_stream() is before  # the module hands out a fresh object per call
    with s.context():
        assert dev.module.current_stream() == s.torch_stream and dev.current_stream() is s
    assert dev.current_stream() is before
    e = s.record_event(dev.event(enable_timing=True))
    assert type(e) is TorchEvent and e.torch_event.recorded_on is s.torch_stream
    s.wait_event(e)
    assert s.torch_stream.waited_events == [e.torch_event]
    end = dev.event(enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):  # the module's ValueError, as the contract's RuntimeError
        e.elapsed_time(end)
    with pytest.raises(RuntimeError, match="enable_timing"):
        dev.event().elapsed_time(end)
    with pytest.raises(TypeError, match="TorchStream"):
        e.record(Bare().stream())
    assert dev.synced == []  # the module's streams, not the device-wide barrier


def test_the_default_finds_a_complete_device_module_through_torch():
    code = f"""
import sys
sys.path[:0] = [{str(DOUBLE)!r}, {str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
import toy_accel, torch
from test_device_defaults import Bare

class Toy(Bare):
    device_type = "toyacc"

dev = Toy()
assert dev._stream_module() is torch.get_device_module("toyacc")
s, e = dev.stream(), dev.event(enable_timing=True)
with s.context():
    assert dev.current_stream() is s
e.record(s)
print(type(s).__name__, type(e).__name__, s.query(), dev.synced)
"""
    assert testenv.fresh_python(code).split() == ["TorchStream", "TorchEvent", "True", "[]"]
