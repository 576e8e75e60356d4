"""Ascend NPUs as chipset devices, on ``torch.npu``.

The runtime applies ``ASCEND_RT_VISIBLE_DEVICES`` itself (device indices here are
logical, 0..device_count()-1). torch_npu refuses to run in a process forked after
the NPU was initialised, so launchers must use the ``spawn`` start method
(:attr:`AscendDevice.start_method`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from chipset.interfaces import Device, DeviceProperties, Event, Stream
from chipset_ascend._runtime import DEVICE_TYPE, npu
from chipset_ascend.properties import profile_for_soc_name

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class AscendEvent(Event):
    def __init__(self, enable_timing: bool = False, event=None):
        super().__init__(enable_timing)
        self._event = event if event is not None else npu().Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self._event.record(stream._stream if isinstance(stream, AscendStream) else None)

    def wait(self, stream: Stream | None = None) -> None:
        self._event.wait(stream._stream if isinstance(stream, AscendStream) else None)

    def synchronize(self) -> None:
        self._event.synchronize()

    def query(self) -> bool:
        return bool(self._event.query())

    def elapsed_time(self, end: Event) -> float:
        if not isinstance(end, AscendEvent):
            raise TypeError(f"elapsed_time needs an ascend event, found {type(end).__name__}")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        return float(self._event.elapsed_time(end._event))


class AscendStream(Stream):
    def __init__(self, stream):
        self._stream = stream

    # torch.npu.current_stream() hands out a new Python object per call; two wrappers
    # are the same stream when the torch_npu streams compare equal.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, AscendStream) and self._stream == other._stream

    def __hash__(self) -> int:
        try:
            return hash(self._stream)
        except TypeError:
            return id(self._stream)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, AscendEvent):
            raise TypeError(f"wait_event needs an ascend event, found {type(event).__name__}")
        self._stream.wait_event(event._event)

    def wait_stream(self, other: Stream) -> None:
        if not isinstance(other, AscendStream):
            raise TypeError(f"wait_stream needs an ascend stream, found {type(other).__name__}")
        self._stream.wait_stream(other._stream)

    def query(self) -> bool:
        return bool(self._stream.query())

    def record_event(self, event: Event | None = None) -> Event:
        ev = event if event is not None else AscendEvent()
        if not isinstance(ev, AscendEvent):
            raise TypeError(f"record_event needs an ascend event, found {type(ev).__name__}")
        ev.record(self)
        return ev

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        with npu().stream(self._stream):
            yield self


class AscendDevice(Device):
    backend_name = "ascend"
    device_type = DEVICE_TYPE
    visible_devices_env = VISIBLE_ENV
    start_method = "spawn"
    """Multiprocessing start method launchers must use: torch_npu refuses fork after init."""

    def __init__(self) -> None:
        # One wrapper per torch_npu stream, so current_stream() inside ``s.context()``
        # is ``s`` itself (torch_npu returns a fresh, equal Python object per call).
        self._wrappers: dict[object, AscendStream] = {}

    def _wrap(self, raw) -> AscendStream:
        try:
            hash(raw)
            key = raw
        except TypeError:  # a stream type without __hash__: identity is all we have
            key = id(raw)
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = AscendStream(raw)
        return w

    def device_count(self) -> int:
        return int(npu().device_count())

    def _set_device(self, index: int) -> None:
        npu().set_device(index)

    def _current_device(self) -> int:
        return int(npu().current_device())

    def _torch_device(self, index: int) -> torch.device:
        return torch.device(self.device_type, index)

    def _synchronize(self, index: int) -> None:
        npu().synchronize(index)

    def _properties(self, index: int) -> DeviceProperties:
        props = npu().get_device_properties(index)
        name = str(getattr(props, "name", "") or npu().get_device_name(index))
        total = int(props.total_memory)
        known = profile_for_soc_name(name)
        cores = getattr(props, "cube_core_num", None)
        if known is None:
            # An Ascend part we have no data for: report what the runtime says, no rates.
            return DeviceProperties(
                name=name, index=index, total_memory=total, multiprocessor_count=cores,
                estimated=True, source=f"torch.npu.get_device_properties({index}); no chipset profile for {name!r}",
            )
        return DeviceProperties(
            name=name,
            index=index,
            total_memory=total,  # what the runtime lets us use, not the HBM size
            peak_flops=dict(known.peak_flops),
            memory_bandwidth=known.memory_bandwidth,
            intra_node_bandwidth=known.intra_node_bandwidth,
            inter_node_bandwidth=known.inter_node_bandwidth,
            intra_node_latency=known.intra_node_latency,
            inter_node_latency=known.inter_node_latency,
            multiprocessor_count=cores,
            estimated=known.estimated,
            source=f"memory: torch.npu.get_device_properties({index}); rates: {known.source}",
        )

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        # No float64: the cube unit has none and many NPU kernels lack it.
        base = [torch.float32, torch.float16]
        if self.bf16_supported():
            base.append(torch.bfloat16)
        return (*base, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)

    def bf16_supported(self) -> bool:
        """bfloat16 is a 910B-generation feature (the 910A has none); torch_npu answers."""
        return bool(npu().is_bf16_supported())

    # RNG
    def manual_seed(self, seed: int) -> None:
        npu().manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        npu().manual_seed_all(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self.current_device() if index is None else index)
        return npu().get_rng_state(i)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self.current_device() if index is None else index)
        npu().set_rng_state(state, i)

    # streams and events
    def stream(self) -> Stream:
        return self._wrap(npu().Stream())

    def current_stream(self) -> Stream:
        return self._wrap(npu().current_stream())

    def event(self, enable_timing: bool = False) -> Event:
        return AscendEvent(enable_timing)
