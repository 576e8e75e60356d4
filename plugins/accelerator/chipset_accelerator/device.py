"""A chipset Device over a torch device module (``torch.xpu``, ``torch.cuda``, a vendor's
PrivateUse1 module): devices, streams, events and RNG by delegation, nothing vendor-specific.

Every call goes to ``self.module`` (the ``torch.<type>`` module), resolved through
``torch.get_device_module`` unless a subclass or a test hands one in. Vendor plugins
subclass :class:`AcceleratorDevice` and keep only their differences (properties tables,
dtypes, error hints).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator, Sequence

import torch

from chipset.errors import BackendUnavailableError, ConfigError
from chipset.interfaces import Device, DeviceProperties, Event, Stream


class AcceleratorEvent(Event):
    def __init__(self, module, enable_timing: bool = False):
        super().__init__(enable_timing)
        self.torch_event = module.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self.torch_event.record(_raw_stream(stream))

    def wait(self, stream: Stream | None = None) -> None:
        self.torch_event.wait(_raw_stream(stream))

    def synchronize(self) -> None:
        self.torch_event.synchronize()

    def query(self) -> bool:
        return bool(self.torch_event.query())

    def elapsed_time(self, end: Event) -> float:
        if not isinstance(end, AcceleratorEvent):
            raise TypeError(f"elapsed_time needs an event of the same device, found {type(end).__name__}")
        # The interface asks for RuntimeError on non-timing or unrecorded events; torch 2.11
        # raises ValueError for both on CUDA, older releases RuntimeError.
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        try:
            return float(self.torch_event.elapsed_time(end.torch_event))
        except ValueError as exc:
            raise RuntimeError(f"elapsed_time: {exc}") from exc


def _raw_stream(stream: Stream | None):
    if stream is None:
        return None
    if not isinstance(stream, AcceleratorStream):
        raise TypeError(f"expected a stream of the same device, found {type(stream).__name__}")
    return stream.torch_stream


class AcceleratorStream(Stream):
    def __init__(self, module, torch_stream):
        self._module = module
        self.torch_stream = torch_stream

    # Device modules hand out a new Python object per current_stream() call; two wrappers
    # are the same stream when the torch streams compare equal.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, AcceleratorStream) and self.torch_stream == other.torch_stream

    def __hash__(self) -> int:
        return _key(self.torch_stream).__hash__()

    def synchronize(self) -> None:
        self.torch_stream.synchronize()

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, AcceleratorEvent):
            raise TypeError(f"wait_event needs an event of the same device, found {type(event).__name__}")
        self.torch_stream.wait_event(event.torch_event)

    def wait_stream(self, other: Stream) -> None:
        self.torch_stream.wait_stream(_raw_stream(other))

    def query(self) -> bool:
        return bool(self.torch_stream.query())

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else AcceleratorEvent(self._module)
        event.record(self)
        return event

    @contextlib.contextmanager
    def context(self) -> Iterator[Stream]:
        with self._module.stream(self.torch_stream):
            yield self


def _key(raw):
    try:
        hash(raw)
        return raw
    except TypeError:  # a stream type without __hash__: identity is all there is
        return id(raw)


class AcceleratorDevice(Device):
    """The devices of one torch device type. ``device_type`` is where tensors live (a test
    double may place them on the host); ``accelerator_type`` names the torch module."""

    backend_name = "accelerator"
    visible_devices_env = "CHIPSET_ACCELERATOR_VISIBLE_DEVICES"
    """Read by torch for no device type: each runtime has its own (ZE_AFFINITY_MASK on XPU,
    HIP/CUDA_VISIBLE_DEVICES on ROCm); device_count() honours this one on top, so a launcher
    can narrow any accelerator the same way."""

    def __init__(self, accelerator_type: str | None = None, module=None) -> None:
        if accelerator_type is None:
            from chipset_accelerator import accelerator_type as current

            accelerator_type = current()
            if accelerator_type is None:
                raise BackendUnavailableError(
                    "accelerator: this torch build reports no accelerator (torch.accelerator.current_accelerator() "
                    "is None); install the torch build for your device or choose another backend with CHIPSET_BACKEND."
                )
        self.accelerator_type = accelerator_type
        if "device_type" not in vars(type(self)) and "device_type" not in vars(self):
            self.device_type = accelerator_type
        self._explicit_module = module
        # One wrapper per torch stream, so current_stream() inside ``s.context()`` is ``s``.
        self._wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @property
    def module(self):
        """The ``torch.<type>`` module every call goes to (looked up at call time)."""
        if self._explicit_module is not None:
            return self._explicit_module
        return torch.get_device_module(self.accelerator_type)

    def _visible(self) -> list[int] | None:
        """Physical indices left by CHIPSET_ACCELERATOR_VISIBLE_DEVICES, or None (all)."""
        raw = os.environ.get(AcceleratorDevice.visible_devices_env)
        if raw is None or self.visible_devices_env != AcceleratorDevice.visible_devices_env:
            return None
        n = int(self.module.device_count())
        ids = [x.strip() for x in raw.split(",") if x.strip()]
        if not all(x.isdigit() and int(x) < n for x in ids):
            raise ConfigError(f"{self.visible_devices_env}={raw!r}: expected comma-separated device indices "
                              f"below {n} (the {self.accelerator_type} devices torch sees); unset it to use all")
        return [int(x) for x in ids]

    def _phys(self, index: int) -> int:
        """The torch index of visible device ``index``."""
        ids = self._visible()
        return index if ids is None else ids[index]

    def device_count(self) -> int:
        ids = self._visible()
        return int(self.module.device_count()) if ids is None else len(ids)

    # --- primitives ------------------------------------------------------------
    def _set_device(self, index: int) -> None:
        self.module.set_device(self._phys(index))

    def _current_device(self) -> int:
        current = int(self.module.current_device())
        ids = self._visible()
        return current if ids is None or current not in ids else ids.index(current)

    def _torch_device(self, index: int) -> torch.device:
        return torch.device(self.device_type, self._phys(index))

    def _synchronize(self, index: int) -> None:
        self.module.synchronize(self._phys(index))

    def _properties(self, index: int) -> DeviceProperties:
        from chipset_accelerator.properties import describe

        return describe(self.accelerator_type, self.module, self._phys(index), index)

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if self.bf16_supported():
            dtypes.append(torch.bfloat16)
        return (*dtypes, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)

    def bf16_supported(self) -> bool:
        """The device module's answer where it has ``is_bf16_supported``; else no."""
        ask = getattr(self.module, "is_bf16_supported", None)
        return bool(ask()) if ask is not None else False

    # --- RNG -------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.module.manual_seed_all(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self.current_device() if index is None else index)
        return self.module.get_rng_state(self._phys(i))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self.current_device() if index is None else index)
        self.module.set_rng_state(state, self._phys(i))

    # --- streams and events ----------------------------------------------------
    def has_streams(self) -> bool:
        """Whether the device module has Stream, Event and a stream context."""
        return all(hasattr(self.module, name) for name in ("Stream", "Event", "stream", "current_stream"))

    def _wrap(self, raw) -> AcceleratorStream:
        key = _key(raw)
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = self._stream_class(self.module, raw)
        return w

    _stream_class = AcceleratorStream
    _event_class = AcceleratorEvent

    def stream(self) -> Stream:
        return self._wrap(self.module.Stream())

    def current_stream(self) -> Stream:
        return self._wrap(self.module.current_stream())

    def event(self, enable_timing: bool = False) -> Event:
        return self._event_class(self.module, enable_timing)
