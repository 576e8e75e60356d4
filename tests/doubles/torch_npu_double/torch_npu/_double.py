"""TEST DOUBLE internals: configuration, simulated allocator, control functions for tests."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

GiB = 2**30


def physical_devices() -> int:
    return int(os.environ.get("TORCH_NPU_DOUBLE_DEVICES", "8"))


def soc_name() -> str:
    return os.environ.get("TORCH_NPU_DOUBLE_SOC", "Ascend910B3")


def capacity() -> int:
    return int(os.environ.get("TORCH_NPU_DOUBLE_CAPACITY", str(int(60.96 * GiB))))


def visible() -> list[int]:
    """Physical ids this process sees; the ACL runtime applies ASCEND_RT_VISIBLE_DEVICES."""
    n = physical_devices()
    raw = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None:
        return list(range(n))
    ids = [int(x) for x in raw.split(",") if x.strip()]
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise RuntimeError(f"ASCEND_RT_VISIBLE_DEVICES names device(s) {bad} but only {n} NPU(s) exist")
    return ids


@dataclass
class Counters:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    num_ooms: int = 0


_lock = threading.Lock()
_counters: dict[int, Counters] = {}


def counters(index: int) -> Counters:
    return _counters.setdefault(index, Counters())


def format_size(n: int) -> str:
    # c10's format_size, which torch_npu's allocator message uses.
    if n < 1024:
        return f"{n} bytes"
    if n < 1024**2:
        return f"{n / 1024:.2f} KiB"
    if n < 1024**3:
        return f"{n / 1024**2:.2f} MiB"
    return f"{n / 1024**3:.2f} GiB"


def allocate(nbytes: int, device: int | None = None) -> None:
    """Charge ``nbytes`` to an NPU like the caching allocator; OOM past the capacity."""
    from torch_npu import npu

    index = npu.current_device() if device is None else device
    c = counters(index)
    cap = capacity()
    with _lock:
        grow = max(0, nbytes - (c.reserved - c.allocated))  # cached blocks are reused first
        if c.reserved + grow > cap:
            c.reserved = c.allocated  # free the cache and retry, as the caching allocator does
            grow = nbytes
        if c.reserved + grow > cap:
            c.num_ooms += 1
            free = cap - c.reserved
            msg = (
                f"NPU out of memory. Tried to allocate {format_size(nbytes)} (NPU {index}; "
                f"{format_size(cap)} total capacity; {format_size(c.allocated)} already allocated; "
                f"{format_size(c.allocated)} current active; {format_size(free)} free; "
                f"{format_size(c.reserved)} reserved in total by PyTorch) If reserved memory is >> "
                "allocated memory try setting max_split_size_mb to avoid fragmentation."
            )
            if os.environ.get("TORCH_NPU_DOUBLE_OOM") == "runtime":
                raise RuntimeError(msg)
            raise torch.OutOfMemoryError(msg)
        c.allocated += nbytes
        c.reserved += grow
        c.peak_allocated = max(c.peak_allocated, c.allocated)
        c.peak_reserved = max(c.peak_reserved, c.reserved)


def free(nbytes: int, device: int | None = None) -> None:
    """Release ``nbytes``; the allocator keeps them reserved (cached) until empty_cache."""
    from torch_npu import npu

    c = counters(npu.current_device() if device is None else device)
    with _lock:
        c.allocated -= nbytes


def reset() -> None:
    _counters.clear()


def register_hccl() -> None:
    """Register c10d backend "hccl" (as torch_npu does) creating gloo groups over CPU tensors."""
    import torch.distributed as dist

    if hasattr(dist.Backend, "HCCL"):
        return

    def _create(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", _create, devices=["cpu"])
