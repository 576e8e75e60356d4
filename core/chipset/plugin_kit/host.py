"""Building blocks for a backend whose devices compute on the host CPU.

The shipped ``cpu`` backend and the ``cpu_sim`` simulator both run every kernel eagerly on
the calling thread, so they share one honest model of streams, events and per-device RNG;
a vendor prototyping a backend on the host can start from the same classes.

- Program order on one host thread is a valid schedule for every ordering a device stream
  promises (work after ``wait_event``/``wait_stream`` runs after what it waits for), so the
  Device's serial default (:mod:`chipset.interfaces.streams`) is exact: a stream is always
  complete and events are host timestamps. :class:`HostDevice` keeps to it even where a
  future ``torch.cpu`` grows complete streams.
- Every device shares the host's default generator. Each device index owns an RNG state;
  making a device current swaps its state into the host generator, so seeding device 0 never
  disturbs device 1 (the contract every backend keeps).

- Collectives run over gloo, torch.distributed's CPU engine. On torch 2.13 gloo refuses
  ``avg`` of integer tensors; :class:`HostCollective` does it as a sum then a division
  rounding toward zero.

A subclass of :class:`HostDevice` gives ``backend_name``, ``visible_devices_env``,
``device_count()`` and ``_properties(index)``; one of :class:`HostCollective` gives
``backend_name``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from chipset.interfaces import Collective, Device
from chipset.interfaces.collective import divide_for_avg_

__all__ = ["HOST_DTYPES", "HostCollective", "HostDevice"]

HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32,
               torch.int64, torch.uint8, torch.bool)
"""What the host computes in (half precisions through torch's CPU kernels)."""


class HostDevice(Device):
    """Devices that are the host CPU: the serial streams and events, an RNG state per index."""

    device_type = "cpu"

    def __init__(self) -> None:
        self._current = 0
        self._rng: dict[int, torch.Tensor] = {}
        self._listeners: list[Callable[[int], None]] = []
        self._release_listeners: list[Callable[[], None]] = []

    def on_set_device(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(index)`` whenever a device becomes current (per-device memory accounting hooks in here)."""
        self._listeners.append(fn)

    def on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the process releases its device (:meth:`Device.release`)."""
        self._release_listeners.append(fn)

    def release(self) -> None:
        for fn in self._release_listeners:
            fn()

    def _set_device(self, index: int) -> None:
        if index != self._current:
            self._rng[self._current] = torch.default_generator.get_state()
            if index in self._rng:
                torch.default_generator.set_state(self._rng.pop(index))
        self._current = index
        for fn in self._listeners:
            fn(index)

    def _current_device(self) -> int:
        return self._current

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def _synchronize(self, index: int) -> None:
        pass

    @property
    def supported_dtypes(self) -> Sequence[torch.dtype]:
        return HOST_DTYPES

    # RNG: the current device's state lives in the host generator, the others' in self._rng.
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        state = torch.Generator().manual_seed(int(seed)).get_state()
        for i in range(self.device_count()):
            if i != self._current:
                self._rng[i] = state.clone()
        torch.default_generator.manual_seed(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        i = self._check_index(self._current if index is None else index)
        if i == self._current:
            return torch.default_generator.get_state()
        if i not in self._rng:
            self._rng[i] = torch.Generator().get_state()
        return self._rng[i].clone()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        i = self._check_index(self._current if index is None else index)
        if i == self._current:
            torch.default_generator.set_state(state)
        else:
            self._rng[i] = state.clone()

    def _stream_module(self):
        return None  # work ran when it was issued: the serial default is exact here


def _integer_avg(tensor: torch.Tensor, op: str) -> bool:
    return op == "avg" and not (tensor.is_floating_point() or tensor.is_complex())


class HostCollective(Collective):
    """Collectives over gloo, with the integer ``avg`` gloo lacks done as a sum then a division."""

    c10d_backend = "gloo"

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if not _integer_avg(tensor, op):
            return super().all_reduce(tensor, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().all_reduce(tensor, "sum", group, async_op),
                                 lambda: divide_for_avg_(tensor, n))

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if not _integer_avg(input, op):
            return super().reduce_scatter(output, input, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().reduce_scatter(output, input, "sum", group, async_op),
                                 lambda: divide_for_avg_(output, n))
