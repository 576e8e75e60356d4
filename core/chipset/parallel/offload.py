"""Activation offload: what each block saves for backward waits in host memory.

Every tensor a block's forward saves for backward (``torch.autograd.graph.saved_tensors_hooks``)
is copied to host memory at once and copied back when backward unpacks it, so device memory
holds one block's activations at a time instead of every block's (on a simulated device,
``Memory.host_allocations`` keeps the host copies out of the device accounting). Parameters
and their views stay where they are: they live on the device anyway.

Copies are synchronous: a backend with streams could overlap them with compute (the
planner's ``offload`` time term assumes no overlap, an upper bound).
"""

from __future__ import annotations

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


def apply_offload(blocks: list[nn.Module], memory) -> None:
    """Run each of ``blocks`` with its saved activations offloaded to host memory (module doc)."""
    for block in blocks:
        pack, unpack = _hooks(block, memory)
        forward = block.forward

        def offloaded(*args, _forward=forward, _pack=pack, _unpack=unpack, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                return _forward(*args, **kwargs)

        block.forward = offloaded
