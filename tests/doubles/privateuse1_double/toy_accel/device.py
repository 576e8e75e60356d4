"""TEST DOUBLE: ``torch.toyacc``, the device module of the toy PrivateUse1 device.

Devices, streams and events (work is synchronous: everything runs on the host), one RNG
per device (the current device's is the host generator, since its tensors are host
tensors), and caching-allocator statistics in the layout torch's allocators share.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NAME = "Toy Accelerator T1"
BLOCK = 512
_state = SimpleNamespace(current=0, streams={}, rng={}, counters={}, seen=set(), mode=None)


def capacity() -> int:
    return int(os.environ.get("TOY_ACCEL_DOUBLE_CAPACITY", str(2**30)))


# --- devices -----------------------------------------------------------------------
def device_count() -> int:
    return int(os.environ.get("TOY_ACCEL_DOUBLE_DEVICES", "4"))


def is_available() -> bool:
    return device_count() > 0


def _checked(device=None) -> int:
    if _state.mode is None:  # the first device call starts charging host storages
        _state.mode = _Charge()
        _state.mode.__enter__()
    if device is None:
        i = _state.current
    elif isinstance(device, torch.device):
        i = _state.current if device.index is None else device.index
    elif isinstance(device, str):
        i = torch.device(device).index
        i = _state.current if i is None else i
    else:
        i = int(device)
    if not 0 <= i < device_count():
        raise RuntimeError(f"toyacc: invalid device index {i}; {device_count()} device(s)")
    return i


def set_device(device) -> None:
    i = _checked(device)
    if i != _state.current:
        _state.rng[_state.current] = torch.default_generator.get_state()
        if i in _state.rng:
            torch.default_generator.set_state(_state.rng.pop(i))
    _state.current = i


def current_device() -> int:
    return _state.current


def synchronize(device=None) -> None:
    _checked(device)


def get_device_name(device=None) -> str:
    _checked(device)
    return NAME


def get_device_properties(device=None):
    _checked(device)
    return SimpleNamespace(name=NAME, total_memory=capacity(), multi_processor_count=8)


def is_bf16_supported() -> bool:
    return True


# --- memory --------------------------------------------------------------------------
def _counters(i: int) -> SimpleNamespace:
    return _state.counters.setdefault(i, SimpleNamespace(allocated=0, reserved=0, peak_allocated=0, peak_reserved=0))


def _allocate(nbytes: int, i: int) -> None:
    c = _counters(i)
    grow = max(0, nbytes - (c.reserved - c.allocated))  # cached blocks are reused first
    if c.reserved + grow > capacity():
        c.reserved, grow = c.allocated, nbytes  # free the cache and retry
    if c.reserved + grow > capacity():
        raise torch.OutOfMemoryError(
            f"toyacc out of memory. Tried to allocate {nbytes} bytes (device {i}; {capacity()} bytes total "
            f"capacity; {c.allocated} bytes allocated)")
    c.allocated += nbytes
    c.reserved += grow
    c.peak_allocated = max(c.peak_allocated, c.allocated)
    c.peak_reserved = max(c.peak_reserved, c.reserved)


def _free(key: int, nbytes: int, i: int) -> None:
    _state.seen.discard(key)
    _counters(i).allocated -= nbytes


class _Charge(TorchDispatchMode):
    """Every new host storage is charged to the current toy device (its tensors are host tensors)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                s = t.untyped_storage()
                key = s._cdata
                if key in _state.seen or s.nbytes() == 0:
                    continue
                nbytes = (s.nbytes() + BLOCK - 1) // BLOCK * BLOCK
                _allocate(nbytes, _state.current)
                _state.seen.add(key)
                weakref.finalize(s, _free, key, nbytes, _state.current)
        return out


def memory_stats(device=None) -> dict[str, int]:
    c = _counters(_checked(device))
    if c.peak_reserved == 0:
        return {}
    return {"allocated_bytes.all.current": c.allocated, "allocated_bytes.all.peak": c.peak_allocated,
            "reserved_bytes.all.current": c.reserved, "reserved_bytes.all.peak": c.peak_reserved,
            "active_bytes.all.current": c.allocated, "active_bytes.all.peak": c.peak_allocated}


def reset_peak_memory_stats(device=None) -> None:
    c = _counters(_checked(device))
    c.peak_allocated, c.peak_reserved = c.allocated, c.reserved


def empty_cache() -> None:
    for c in _state.counters.values():
        c.reserved = c.allocated


def mem_get_info(device=None) -> tuple[int, int]:
    c = _counters(_checked(device))
    return capacity() - c.reserved, capacity()


# --- streams and events (synchronous: the host has already done the work) ---------------
class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: int | None = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter_ns()

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) / 1e6


class Stream:
    def __init__(self, device=None, priority: int = 0):
        self.device_index = _checked(device)

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, Event):
            raise TypeError("wait_event expects a torch.toyacc.Event")

    def wait_stream(self, stream: Stream) -> None:
        if not isinstance(stream, Stream):
            raise TypeError("wait_stream expects a torch.toyacc.Stream")

    def query(self) -> bool:
        return True


def current_stream(device=None) -> Stream:
    i = _checked(device)
    if i not in _state.streams:
        _state.streams[i] = Stream(i)
    return _state.streams[i]


@contextlib.contextmanager
def stream(s: Stream | None):
    if s is None:
        yield
        return
    prev = _state.streams.get(s.device_index)
    _state.streams[s.device_index] = s
    try:
        yield
    finally:
        _state.streams[s.device_index] = prev if prev is not None else Stream(s.device_index)


# --- RNG: one per device; the current device's is the host generator -------------------
def manual_seed(seed: int) -> None:
    _checked()
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    state = torch.Generator().manual_seed(int(seed)).get_state()
    for i in range(device_count()):
        if i != _state.current:
            _state.rng[i] = state.clone()
    torch.default_generator.manual_seed(int(seed))


def get_rng_state(device=None) -> torch.Tensor:
    i = _checked(device)
    if i == _state.current:
        return torch.default_generator.get_state()
    return _state.rng.setdefault(i, torch.Generator().get_state()).clone()


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    i = _checked(device)
    if i == _state.current:
        torch.default_generator.set_state(new_state)
    else:
        _state.rng[i] = new_state.clone()
