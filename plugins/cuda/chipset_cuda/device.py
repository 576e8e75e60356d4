"""NVIDIA GPUs through torch.cuda: devices, properties, streams, events, RNG.

Visibility is CUDA's own: ``CUDA_VISIBLE_DEVICES`` renumbers the GPUs this process sees
as 0..n-1 and every index here is one of those. ``cuda`` is injectable so the unit tests
can drive this module with a named double of ``torch.cuda`` on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator, Sequence

import torch

from chipset.errors import BackendUnavailableError
from chipset.interfaces import Device, DeviceProperties, Event, Stream
from chipset_cuda import VISIBLE_ENV
from chipset_cuda.properties import describe


def dtypes_for(compute_capability: tuple[int, int]) -> tuple[torch.dtype, ...]:
    """Tensor dtypes GPUs of this compute capability support natively."""
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool]
    if compute_capability >= (8, 0):  # bf16 tensor cores from Ampere on
        dtypes.append(torch.bfloat16)
    if compute_capability >= (8, 9):  # FP8 tensor cores: Ada, Hopper, Blackwell
        dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
    return tuple(dtypes)


class CudaEvent(Event):
    def __init__(self, cuda, enable_timing: bool = False):
        super().__init__(enable_timing)
        self.torch_event = cuda.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self.torch_event.record(stream.torch_stream if stream is not None else None)

    def wait(self, stream: Stream | None = None) -> None:
        self.torch_event.wait(stream.torch_stream if stream is not None else None)

    def synchronize(self) -> None:
        self.torch_event.synchronize()

    def query(self) -> bool:
        return bool(self.torch_event.query())

    def elapsed_time(self, end: Event) -> float:
        # The interface asks for RuntimeError on non-timing or unrecorded events; torch 2.11
        # raises ValueError for both (seen on an H200), older releases RuntimeError.
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        try:
            return float(self.torch_event.elapsed_time(end.torch_event))
        except ValueError as exc:
            raise RuntimeError(f"elapsed_time: {exc}") from exc


class CudaStream(Stream):
    def __init__(self, cuda, torch_stream):
        self._cuda = cuda
        self.torch_stream = torch_stream

    def synchronize(self) -> None:
        self.torch_stream.synchronize()

    def wait_event(self, event: Event) -> None:
        self.torch_stream.wait_event(event.torch_event)

    def wait_stream(self, other: Stream) -> None:
        self.torch_stream.wait_stream(other.torch_stream)

    def query(self) -> bool:
        return bool(self.torch_stream.query())

    def record_event(self, event: Event | None = None) -> Event:
        event = event or CudaEvent(self._cuda)
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        with self._cuda.stream(self.torch_stream):
            yield self


class CudaDevice(Device):
    backend_name = "cuda"
    device_type = "cuda"
    visible_devices_env = VISIBLE_ENV

    def __init__(self, cuda=None) -> None:
        self._cuda = cuda if cuda is not None else torch.cuda
        # One wrapper per torch stream, so current_stream() inside ``s.context()`` is ``s``
        # itself: torch.cuda.current_stream() returns a fresh, equal object on every call.
        self._wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        if self.device_count() == 0:
            visible = os.environ.get(VISIBLE_ENV)
            hint = f" ({VISIBLE_ENV}={visible!r})" if visible is not None else ""
            raise BackendUnavailableError(
                f"cuda: no GPU is visible to this process{hint}; check the driver with nvidia-smi, "
                f"widen {VISIBLE_ENV}, or choose another backend with CHIPSET_BACKEND."
            )

    def device_count(self) -> int:
        return int(self._cuda.device_count())

    def compute_capability(self, index: int | None = None) -> tuple[int, int]:
        i = self._check_index(self.current_device() if index is None else index)
        return tuple(self._cuda.get_device_capability(i))

    def min_compute_capability(self) -> tuple[int, int]:
        """The lowest compute capability among visible GPUs: what every rank can rely on."""
        return min(self.compute_capability(i) for i in range(self.device_count()))

    # --- primitives ------------------------------------------------------------
    def _set_device(self, index: int) -> None:
        self._cuda.set_device(index)

    def _current_device(self) -> int:
        return int(self._cuda.current_device())

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def _synchronize(self, index: int) -> None:
        self._cuda.synchronize(index)

    def _properties(self, index: int) -> DeviceProperties:
        p = self._cuda.get_device_properties(index)
        clock_khz = getattr(p, "clock_rate", None)  # not every torch build exposes it
        return describe(
            p.name,
            index,
            int(p.total_memory),
            (int(p.major), int(p.minor)),
            int(p.multi_processor_count),
            clock_hz=clock_khz * 1e3 if clock_khz else None,
        )

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        return dtypes_for(self.min_compute_capability())

    # --- RNG -------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._cuda.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self._cuda.manual_seed_all(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self.current_device() if index is None else index)
        return self._cuda.get_rng_state(i)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self.current_device() if index is None else index)
        self._cuda.set_rng_state(state, i)

    # --- streams and events ----------------------------------------------------
    def _wrap(self, raw) -> CudaStream:
        w = self._wrappers.get(raw)
        if w is None:
            w = self._wrappers[raw] = CudaStream(self._cuda, raw)
        return w

    def stream(self) -> Stream:
        return self._wrap(self._cuda.Stream())

    def current_stream(self) -> Stream:
        return self._wrap(self._cuda.current_stream())

    def event(self, enable_timing: bool = False) -> Event:
        return CudaEvent(self._cuda, enable_timing)
