"""Streams and events: ordering, contexts, timing and the errors real backends give.

Every backend has streams and events (a backend that writes none gets the Device defaults,
chipset.interfaces.streams), so the basic contract is checked for everyone: streams and
recorded events complete, ``elapsed_time`` raises RuntimeError without ``enable_timing`` or
on an unrecorded event. Contexts and ordering across streams are checked where the backend
declares ``streams``, the timing figures where it declares ``event_timing``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import torch

from chipset.interfaces import Event, Stream

if TYPE_CHECKING:
    from chipset.loader import Backend


@pytest.fixture
def streams(caps):
    if not caps.streams:
        pytest.skip("backend does not declare capability streams")


@pytest.fixture
def timing(caps):
    if not caps.event_timing:
        pytest.skip("backend does not declare capability event_timing")


def test_current_stream_is_a_stream(backend: Backend):
    assert isinstance(backend.device.current_stream(), Stream)


def test_stream_context_makes_it_current_and_restores(backend: Backend, streams):
    d = backend.device
    before = d.current_stream()
    s = d.stream()
    with s.context():
        assert d.current_stream() is s
    assert d.current_stream() is before


def test_recorded_event_completes_after_synchronize(backend: Backend, dev):
    d = backend.device
    x = torch.ones(1000, device=dev) * 3
    e = d.current_stream().record_event()
    assert isinstance(e, Event)
    e.synchronize()
    assert e.query() is True
    assert float(x.sum()) == 3000.0
    mark = d.event()
    mark.record()
    mark.synchronize()
    assert mark.query() is True


def test_event_recorded_on_a_stream_in_its_context_completes(backend: Backend, streams, dev):
    s = backend.device.stream()
    with s.context():
        x = torch.ones(1000, device=dev) * 3
        e = s.record_event()
    e.synchronize()
    assert e.query() is True
    assert float(x.sum()) == 3000.0


def test_wait_event_orders_work_across_streams(backend: Backend, streams, dev):
    d = backend.device
    s1, s2 = d.stream(), d.stream()
    with s1.context():
        x = torch.full((4096,), 2.0, device=dev)
        x.mul_(5)
        e = s1.record_event()
    s2.wait_event(e)
    with s2.context():
        y = x + 1
    s2.synchronize()
    assert torch.equal(y.cpu(), torch.full((4096,), 11.0))


def test_wait_stream_orders_work(backend: Backend, streams, dev):
    d = backend.device
    s1, s2 = d.stream(), d.stream()
    with s1.context():
        x = torch.arange(4096, device=dev, dtype=torch.float32) * 2
    s2.wait_stream(s1)
    with s2.context():
        y = x.sum()
    s2.synchronize()
    assert float(y) == float(sum(range(4096)) * 2)


def test_stream_synchronize_and_query(backend: Backend):
    s = backend.device.stream()
    s.synchronize()
    assert s.query() is True


def test_elapsed_time_is_positive_and_covers_the_interval(backend: Backend, timing, dev):
    d = backend.device
    start, end = d.event(enable_timing=True), d.event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    _ = torch.ones(256, device=dev) * 2
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    assert ms >= 0, f"elapsed_time reported negative time: {ms} ms"
    assert ms >= 20, f"elapsed_time {ms} ms is shorter than the 50 ms slept between the events"
    assert ms < 10_000


def test_elapsed_time_is_monotonic(backend: Backend, timing):
    d = backend.device
    a, b, c = (d.event(enable_timing=True) for _ in range(3))
    a.record()
    time.sleep(0.01)
    b.record()
    time.sleep(0.01)
    c.record()
    c.synchronize()
    ab, ac = a.elapsed_time(b), a.elapsed_time(c)
    assert 0 <= ab <= ac, f"a->b {ab} ms, a->c {ac} ms"


def test_elapsed_time_without_timing_raises(backend: Backend):
    d = backend.device
    a, b = d.event(enable_timing=False), d.event(enable_timing=False)
    a.record()
    b.record()
    b.synchronize()
    with pytest.raises(RuntimeError):
        a.elapsed_time(b)


def test_elapsed_time_on_unrecorded_event_raises(backend: Backend):
    d = backend.device
    a, b = d.event(enable_timing=True), d.event(enable_timing=True)
    a.record()
    with pytest.raises(RuntimeError):
        a.elapsed_time(b)
