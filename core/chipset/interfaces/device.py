"""The Device interface: devices, their properties, streams, events and RNG.

Stream and Event (the interfaces and their default implementations) live in
:mod:`chipset.interfaces.streams`; a backend need not write them.

Public methods validate their arguments and translate errors once, here; a backend
overrides only the narrow ``_primitive`` methods.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from chipset.errors import DeviceIndexError, UnsupportedDTypeError
from chipset.interfaces.streams import (
    Event,
    SerialEvent,
    SerialStream,
    Stream,
    TorchEvent,
    has_torch_streams,
    serial_current,
    wrap,
)

__all__ = ["Device", "DeviceProperties", "Stream", "Event", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceProperties:
    """What the planner and MFU need to know about one device. Rates are per second."""

    name: str
    """Marketing or profile name, e.g. ``"NVIDIA H100 80GB HBM3"`` or ``"sim-generic"``."""
    index: int
    """Index among the devices visible to this process."""
    total_memory: int
    """Device memory capacity in bytes."""
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype name (``"bfloat16"``, ``"float32"``, ...)."""
    memory_bandwidth: float = 0.0
    """Device memory bandwidth in bytes/s."""
    intra_node_bandwidth: float = 0.0
    """Device-to-device bandwidth within a node, bytes/s per direction."""
    inter_node_bandwidth: float = 0.0
    """Bandwidth to other nodes per device, bytes/s per direction."""
    intra_node_latency: float = 0.0
    """Latency of one message within a node, seconds."""
    inter_node_latency: float = 0.0
    """Latency of one message across nodes, seconds."""
    kernel_launch_latency: float = 0.0
    """Least time one kernel occupies the device's stream when the host issues kernels one by
    one (launch plus framework dispatch), seconds; 0.0 lets the planner use its default."""
    step_host_overhead: float = 0.0
    """Host time per optimizer step outside the kernels (data, zero_grad, scheduler, logging),
    seconds; 0.0 lets the planner use its default."""
    matmul_efficiency: float = 0.0
    """Fraction of the dense peak that large, well-shaped matrix multiplies sustain (cuBLAS-
    class kernels at the clocks the part holds under load); 0.0 lets the planner use its default."""
    attention_efficiency: float = 0.0
    """Fraction of the dense peak a fused (flash) attention kernel sustains over forward and
    backward; 0.0 lets the planner use its default."""
    matmul_half_dim: float = 0.0
    """The shape of the device's GEMM efficiency curve: the smallest GEMM dimension d at which
    a multiply reaches half of ``matmul_efficiency`` (the planner's curve is
    matmul_efficiency · d / (d + matmul_half_dim)); 0.0 lets the planner use its default."""
    compute_capability: tuple[int, int] | None = None
    """Vendor compute capability where meaningful (CUDA ``(9, 0)``); else None."""
    multiprocessor_count: int | None = None
    """Streaming multiprocessors / AI cores, where known."""
    estimated: bool = False
    """True when the rates are labelled estimates rather than a cited datasheet value."""
    source: str = ""
    """Where the rates come from (datasheet, profile name)."""

    def peak_flops_for(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for ``dtype``; 0.0 when the device declares none."""
        key = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return float(self.peak_flops.get(key, 0.0))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_flops"] = dict(self.peak_flops)
        if self.compute_capability is not None:
            d["compute_capability"] = list(self.compute_capability)
        return d


class Device(ABC):
    """The devices of one backend as seen by this process."""

    backend_name: str = ""
    """The chipset backend name, e.g. ``"cpu_sim"``."""
    device_type: str = ""
    """The torch device type tensors of this backend live on, e.g. ``"cpu"``."""
    visible_devices_env: str = ""
    """Environment variable that restricts visible devices, e.g. ``"CUDA_VISIBLE_DEVICES"``."""

    # --- devices -------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int:
        """Number of devices visible to this process."""

    def set_device(self, index: int) -> None:
        """Make device ``index`` current for this process; raises DeviceIndexError out of range."""
        self._set_device(self._check_index(index))

    def current_device(self) -> int:
        """Index of the current device."""
        return self._current_device()

    def release(self) -> None:
        """This process is done with its device: a run that trained inside the caller's
        process (``chipset train`` with one rank, a notebook) has ended. A backend that
        installed process-wide state when a device was set (a dispatch mode, a patched torch
        function) removes it here; :meth:`set_device` installs it again. Default: nothing."""
        return None

    def torch_device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` tensors on device ``index`` (default: current) use."""
        i = self._check_index(self.current_device() if index is None else index)
        return self._torch_device(i)

    def synchronize(self, index: int | None = None) -> None:
        """Block until all work on device ``index`` (default: current) has completed."""
        self._synchronize(self._check_index(self.current_device() if index is None else index))

    def properties(self, index: int | None = None) -> DeviceProperties:
        """Properties of device ``index`` (default: current)."""
        return self._properties(self._check_index(self.current_device() if index is None else index))

    # --- dtypes --------------------------------------------------------------
    @property
    @abstractmethod
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        """Dtypes tensors on this device may have."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise UnsupportedDTypeError unless ``dtype`` is declared supported."""
        if dtype not in self.supported_dtypes:
            names = ", ".join(dtype_name(d) for d in self.supported_dtypes)
            raise UnsupportedDTypeError(
                f"{self.backend_name} does not support dtype {dtype_name(dtype)}; "
                f"supported dtypes: {names}. Choose one of those (e.g. set the precision in the config)."
            )

    # --- RNG -----------------------------------------------------------------
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the RNG of the current device."""

    @abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the RNG of every visible device."""

    @abstractmethod
    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """RNG state of device ``index`` (default: current) as a CPU uint8 tensor."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore an RNG state from :meth:`get_rng_state`."""

    @contextlib.contextmanager
    def fork_rng(self, devices: Sequence[int] | None = None, enabled: bool = True) -> Iterator[None]:
        """Run the block with forked RNG: device (and host) RNG state is restored on exit."""
        if not enabled:
            yield
            return
        indices = list(range(self.device_count())) if devices is None else [self._check_index(i) for i in devices]
        cpu_state = torch.get_rng_state()
        states = [(i, self.get_rng_state(i)) for i in indices]
        try:
            yield
        finally:
            torch.set_rng_state(cpu_state)
            for i, s in states:
                self.set_rng_state(s, i)

    # --- streams and events --------------------------------------------------
    # Optional: the defaults below are the device module's own streams and events where it
    # has complete ones, else the serial default (interfaces/streams.py says exactly what
    # each does). A backend overrides them, or just ``_stream_module``, to do otherwise.
    def stream(self) -> Stream:
        """A new stream on the current device."""
        module = self._stream_module()
        if module is None:
            return SerialStream(self, self.current_device())
        return wrap(self, module, module.Stream())

    def current_stream(self) -> Stream:
        """The current stream of the current device."""
        module = self._stream_module()
        if module is None:
            return serial_current(self)
        return wrap(self, module, module.current_stream())

    def event(self, enable_timing: bool = False) -> Event:
        """A new event; ``enable_timing=True`` allows ``elapsed_time``."""
        module = self._stream_module()
        if module is None:
            return SerialEvent(self, enable_timing)
        return TorchEvent(module, enable_timing)

    def _stream_module(self):
        """The torch device module whose streams and events the defaults wrap, or None for the
        serial default: ``torch.get_device_module(device_type)`` where it has complete ones
        (``chipset.interfaces.streams.has_torch_streams``; ``torch.cpu`` has not)."""
        try:
            module = torch.get_device_module(self.device_type)
        except (RuntimeError, ValueError, AttributeError):  # no such device type, or no module for it
            return None
        return module if has_torch_streams(module) else None

    # --- primitives a backend overrides --------------------------------------
    @abstractmethod
    def _set_device(self, index: int) -> None: ...

    @abstractmethod
    def _current_device(self) -> int: ...

    @abstractmethod
    def _torch_device(self, index: int) -> torch.device: ...

    @abstractmethod
    def _synchronize(self, index: int) -> None: ...

    @abstractmethod
    def _properties(self, index: int) -> DeviceProperties: ...

    def _check_index(self, index: int) -> int:
        n = self.device_count()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
            raise DeviceIndexError(
                f"{self.backend_name}: device index {index!r} is out of range; "
                f"{n} device(s) visible (valid: 0..{n - 1}). Check {self.visible_devices_env or 'the visible-devices setting'}."
            )
        return index
