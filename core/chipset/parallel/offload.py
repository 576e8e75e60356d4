"""Activation offload: what each block saves for backward waits in host memory.

Every tensor a block's forward saves for backward (``torch.autograd.graph.saved_tensors_hooks``)
is copied to host memory and copied back when backward unpacks it, so device memory holds one
block's activations at a time instead of every block's (on a simulated device,
``Memory.host_allocations`` keeps the host copies out of the device accounting). Parameters
and their views stay where they are: they live on the device anyway.

Without a ``device`` (a backend that does not declare ``Capabilities.streams``) the copies run
in program order, synchronously. With one, they run on a side stream of that Device and the
compute stream goes on meanwhile; events order the two:

- forward: the side stream waits for the compute stream (which produced the saved tensor),
  copies it to host memory and records an event. The source tensor stays referenced until that
  event has completed, so its memory is not handed out again while the copy reads it.
- backward: the tensor comes back into memory allocated on the compute stream (where autograd
  frees it), copied on the side stream after waiting for the compute stream; the compute stream
  waits for the copy's event before autograd uses the tensor. Unpacking a tensor prefetches
  the one packed before it (backward unpacks in about reverse pack order), across block
  boundaries: the next block's last tensor is on its way while this block's first is in use.
  A prefetch costs one saved tensor of device memory beside the block in backward.

No vendor API is named: the side stream, its events and the waits are the backend's
``Device.stream``/``Stream``/``Event`` (interfaces/device.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["apply_offload"]


def _hooks(block: nn.Module, memory):
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in params:
            return t
        with memory.host_allocations():
            host = torch.empty_like(t, device="cpu")  # same strides: backward's kernels see the same layout
            host.copy_(t)
        return (host, t.device)

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        host, device = saved
        out = torch.empty_like(host, device=device)
        out.copy_(host)
        return out

    return pack, unpack


class _Saved:
    """One offloaded tensor: its host copy, where it goes back to, the copy back if one is on its
    way, and the tensor packed before it (weakly: a finished step's graph is not kept alive)."""

    __slots__ = ("host", "device", "previous", "prefetched", "unpacked", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, previous):
        self.host, self.device, self.previous = host, device, previous
        self.prefetched = None
        self.unpacked = False


class _SideStream:
    """The copies of every offloaded block on one side stream of ``device`` (module doc)."""

    def __init__(self, device, memory):
        self.device, self.memory = device, memory
        self.stream = device.stream()
        self.in_flight: list[tuple[object, torch.Tensor]] = []  # (copy's event, its source)
        self.last = None  # weakref to the _Saved packed last

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy ``src`` into ``dst`` on the side stream; the copy's event. ``dst`` was allocated and
        ``src`` produced on the compute stream: the side stream waits for it first."""
        self.stream.wait_stream(self.device.current_stream())
        with self.stream.context():
            dst.copy_(src, non_blocking=True)
        event = self.stream.record_event()
        self.in_flight.append((event, src))
        self.in_flight = [(e, s) for e, s in self.in_flight if not e.query()]  # sources no copy reads
        return event

    def fetch(self, saved: _Saved):
        host = saved.host  # allocated on the compute stream; reads no data, so waits for no copy
        out = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=saved.device)
        return out, self.copy(out, saved.host)

    def pack(self, t: torch.Tensor, params: set[int]):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in params:
            return t
        with self.memory.host_allocations():
            host = self.memory.pin_memory(torch.empty_like(t, device="cpu"))
        saved = _Saved(host, t.device, self.last)
        self.copy(host, t)
        self.last = weakref.ref(saved)
        return saved

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        out, ready = saved.prefetched or self.fetch(saved)
        saved.prefetched, saved.unpacked = None, True
        self.device.current_stream().wait_event(ready)
        before = saved.previous() if saved.previous is not None else None
        if before is not None and not before.unpacked and before.prefetched is None:
            before.prefetched = self.fetch(before)
        return out


def apply_offload(blocks: list[nn.Module], memory, device=None) -> None:
    """Run each of ``blocks`` with its saved activations offloaded to host memory (module doc).

    ``device``: the backend's Device where it declares streams (copies overlap compute on a side
    stream), else None (synchronous copies)."""
    side = _SideStream(device, memory) if device is not None else None
    for block in blocks:
        if side is None:
            pack, unpack = _hooks(block, memory)
        else:
            params = {p.untyped_storage().data_ptr() for p in block.parameters()}
            pack, unpack = (lambda t, _p=params: side.pack(t, _p)), side.unpack
        forward = block.forward

        def offloaded(*args, _forward=forward, _pack=pack, _unpack=unpack, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                return _forward(*args, **kwargs)

        block.forward = offloaded
