"""TEST DOUBLE of ``torch.npu`` (``torch_npu.npu``): devices, streams, events, RNG, memory."""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace

import torch

from torch_npu import _double


def _flag(default: bool):
    return SimpleNamespace(allow_hf32=default)


# torch_npu's documented defaults: HF32 off for matmul, on for convolution.
matmul = _flag(False)
conv = _flag(True)

_state = SimpleNamespace(current=0, streams={}, rng={}, initialized=False)


# --- devices -----------------------------------------------------------------
def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return len(_double.visible())


def _index(device=None) -> int:
    if device is None:
        return _state.current
    if isinstance(device, str):  # "npu" or "npu:1" (stock torch cannot parse "npu")
        _, _, idx = device.partition(":")
        return int(idx) if idx else _state.current
    if isinstance(device, torch.device):
        return _state.current if device.index is None else device.index
    return int(device)


def is_initialized() -> bool:
    """True once anything touched a device (device_count does not, as in torch_npu)."""
    return _state.initialized


def _checked(device=None) -> int:
    if not _state.initialized:
        _state.initialized = True
        if os.environ.get("TORCH_NPU_DOUBLE_PLACE_ON_HOST") == "1":
            from torch_npu import _host_allocator

            _host_allocator.activate()
    i = _index(device)
    n = device_count()
    if not 0 <= i < n:
        raise RuntimeError(f"Invalid device ID {i}; {n} NPU(s) visible")
    return i


def set_device(device) -> None:
    i = _checked(device)
    if i != _state.current:  # the current NPU's RNG state lives in the host generator
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
    return _double.soc_name()


def get_device_properties(device=None):
    _checked(device)
    return SimpleNamespace(name=_double.soc_name(), total_memory=_double.capacity(), cube_core_num=20, vector_core_num=40)


def is_bf16_supported() -> bool:
    return not _double.soc_name().startswith("Ascend910A")


# --- memory (CUDA-style allocator statistics) ----------------------------------
def memory_stats(device=None) -> dict[str, int]:
    c = _double.counters(_checked(device))
    if c.reserved == 0 and c.peak_reserved == 0:
        return {}  # like the real allocator before its first allocation
    out: dict[str, int] = {}
    for pool in ("all", "large_pool", "small_pool"):
        share = 1 if pool in ("all", "large_pool") else 0
        out[f"allocated_bytes.{pool}.current"] = c.allocated * share
        out[f"allocated_bytes.{pool}.peak"] = c.peak_allocated * share
        out[f"reserved_bytes.{pool}.current"] = c.reserved * share
        out[f"reserved_bytes.{pool}.peak"] = c.peak_reserved * share
        out[f"active_bytes.{pool}.current"] = c.allocated * share
        out[f"active_bytes.{pool}.peak"] = c.peak_allocated * share
    out["num_ooms"] = c.num_ooms
    return out


def memory_allocated(device=None) -> int:
    return _double.counters(_checked(device)).allocated


def memory_reserved(device=None) -> int:
    return _double.counters(_checked(device)).reserved


def max_memory_allocated(device=None) -> int:
    return _double.counters(_checked(device)).peak_allocated


def max_memory_reserved(device=None) -> int:
    return _double.counters(_checked(device)).peak_reserved


def reset_peak_memory_stats(device=None) -> None:
    c = _double.counters(_checked(device))
    c.peak_allocated, c.peak_reserved = c.allocated, c.reserved


def empty_cache() -> None:
    for i in range(device_count()):
        c = _double.counters(i)
        c.reserved = c.allocated


def mem_get_info(device=None) -> tuple[int, int]:
    c = _double.counters(_checked(device))
    cap = _double.capacity()
    return cap - c.reserved, cap


# --- streams and events ----------------------------------------------------------
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
            raise TypeError("wait_event expects a torch.npu.Event")

    def wait_stream(self, stream: Stream) -> None:
        if not isinstance(stream, Stream):
            raise TypeError("wait_stream expects a torch.npu.Stream")

    def query(self) -> bool:
        return True

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


def current_stream(device=None) -> Stream:
    i = _checked(device)
    if i not in _state.streams:
        _state.streams[i] = Stream(i)
    return _state.streams[i]


default_stream = current_stream


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
        if prev is None:
            _state.streams.pop(s.device_index, None)
        else:
            _state.streams[s.device_index] = prev


# --- RNG: one generator per NPU; the current NPU's is the host generator -------------
# (the double's "NPU" tensors are host tensors, drawn from torch.default_generator)
def manual_seed(seed: int) -> None:
    _checked()
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    state = torch.Generator().manual_seed(int(seed)).get_state()
    for i in range(device_count()):
        if i != _state.current:
            _state.rng[i] = state.clone()
    torch.default_generator.manual_seed(int(seed))


def get_rng_state(device="npu") -> torch.Tensor:
    i = _checked(device)
    if i == _state.current:
        return torch.default_generator.get_state()
    return _state.rng.setdefault(i, torch.Generator().get_state()).clone()


def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("set_rng_state expects a torch.ByteTensor")
    i = _checked(device)
    if i == _state.current:
        torch.default_generator.set_state(new_state)
    else:
        _state.rng[i] = new_state.clone()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()
