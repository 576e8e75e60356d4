"""Exact memory accounting for simulated devices.

Mechanism: once a process binds to a simulated device (``set_device``), a
TorchDispatchMode sees the outputs of every aten op. Each storage seen for the first
time is charged to the current device (``allocated`` += its exact ``nbytes``) and a
weak reference to the storage with a callback credits it back when torch frees it.
Storage Python objects are preserved by torch, so the callback fires exactly when the
memory is released, whatever view kept it alive.

Allocator model (documented, like a caching allocator): blocks are rounded up to
512 bytes (``active``); freed blocks stay ``reserved`` in a cache until
``empty_cache``; an allocation that would take ``active`` past the profile capacity
flushes the cache and, if it still does not fit, raises chipset's OutOfMemoryError
("Tried to allocate N bytes"). The failed output is dropped, so the device stays
usable. Tensors created before the process bound to a device are not counted; the mode
is removed when the process releases its device (``Device.release``, at the end of a run).

Factory ops (``empty``, ``zeros``, ``full``, ``rand`` ... anything with a ``size``
argument and no tensor input) are checked against the capacity *before* they run, so
asking a 16 GiB simulated device for 20 GiB never touches 20 GiB of host memory.
Other ops are charged after they ran (their output size is only known then).

Resizes: ``untyped_storage().resize_(n)`` (how FSDP2 frees and re-materialises unsharded
parameters) bypasses the dispatcher, so binding a device also wraps
``torch.UntypedStorage.resize_``: growing a tracked storage is checked against the
capacity first, and allocated/active follow the new size (shrinking to 0 credits the
bytes back, the freed block goes to the cache). A tensor-level ``resize_`` (an aten op)
is re-synchronised the next time the dispatcher sees the storage.

Overhead: one Python call per aten op, on top of torch's own cost of a Python dispatch
mode (measured in docs/benchmarks.md with benchmarks/sim_accounting_overhead.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from chipset.errors import OutOfMemoryError
from chipset.interfaces import Memory, MemoryStats

BLOCK = 512


def _round(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


@dataclass
class _Counters:
    allocated: int = 0
    active: int = 0
    cached: int = 0
    peak_allocated: int = 0
    peak_active: int = 0
    peak_reserved: int = 0

    @property
    def reserved(self) -> int:
        return self.active + self.cached


class _Tracker(TorchDispatchMode):
    def __init__(self, memory: SimMemory):
        super().__init__()
        self.memory = memory

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise torch wraps __torch_dispatch__ in torch._disable_dynamo, which imports
        # torch._dynamo (and sympy) at the first op: ~1.5 s of CPU in every simulated
        # process, most of a short run's, and a wrapper frame per op. Dynamo only runs once
        # something compiles, which imports it first; __torch_dispatch__ guards itself then.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "torch._dynamo" in sys.modules:
            return _track_outside_dynamo(self, func, args, kwargs or {})
        return self._track(func, args, kwargs or {})

    def _track(self, func, args, kwargs):
        memory = self.memory
        if memory._host.depth:  # host memory (Memory.host_allocations): not the device's
            return func(*args, **kwargs)
        info = _OPS.get(id(func)) or _op_info(func)
        if info[0]:  # only aliases its inputs: nothing new to charge
            return info[2](*args, **kwargs)
        if info[1] >= 0:  # a factory op: checked against the capacity before it runs
            planned = _factory_bytes(info[1], args, kwargs)
            if planned:
                memory._check_capacity(planned)
        out = info[2](*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if out.is_cpu:
                memory._charge(out)
        elif isinstance(out, (tuple, list)):
            self._charge_all(out)
        elif out is not None:
            self._charge_all(tree_flatten(out)[0])
        return out

    def _charge_all(self, seq) -> None:
        # aten outputs are tensors or (nested) tuples and lists of them: walked directly,
        # which costs a fraction of a pytree flatten (the tracker runs for every op).
        for t in seq:
            if isinstance(t, torch.Tensor):
                if t.is_cpu:
                    self.memory._charge(t)
            elif isinstance(t, (tuple, list)):
                self._charge_all(t)


# What torch would have wrapped __torch_dispatch__ in: dynamo never traces the accounting.
_track_outside_dynamo = torch._disable_dynamo(_Tracker._track, recursive=True)


_OPS: dict[int, tuple] = {}
"""id(op) -> (aliasing, position of its ``size`` argument or -1, what to call, the op), read from
the op's schema the first time the tracker sees it. Keyed by ``id``: an ``OpOverload`` hashes in
Python, which cost two Python calls per op on every lookup; the op is kept in the entry, so its
id is never reused. ``what to call`` is the op's C++ callable (``OpOverload.__call__`` is one
Python frame around it)."""


def _op_info(func) -> tuple:
    call = func._op if type(func) is torch._ops.OpOverload else func
    names = [a.name for a in func._schema.arguments]
    info = (_aliasing(func), names.index("size") if "size" in names else -1, call, func)
    _OPS[id(func)] = info
    return info


def _aliasing(func) -> bool:
    """True when ``func``'s outputs are only views of its inputs, or its own input updated in
    place: nothing new to charge, so the tracker skips the work after the call (about half of
    a training step's ops: view, transpose, t, expand, slice, add_, mul_, copy_ ...)."""
    schema = func._schema
    returns = schema.returns
    name = schema.name
    # lift_fresh hands a tensor made outside the dispatcher (torch.tensor(...)) to it: the
    # first time the tracker sees that storage, so it is charged there.
    ok = bool(returns) and all(r.alias_info is not None for r in returns) and "lift" not in name
    if ok and any(r.alias_info.is_write for r in returns):
        # In place on ``self`` only: ``out=`` variants and resize_/set_ may (re)allocate.
        ok = (name.endswith("_") and "resize" not in name and not name.endswith("set_")
              and schema.overload_name != "out" and not schema.overload_name.endswith("_out"))
    return ok


def _factory_bytes(i: int, args, kwargs) -> int | None:
    """Bytes a factory op (its ``size`` argument at position ``i``, no tensor input) will
    allocate; None otherwise."""
    if any(isinstance(a, torch.Tensor) for a in args):
        return None
    size = args[i] if i < len(args) else kwargs.get("size")
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    try:
        return math.prod(int(d) for d in size) * dtype.itemsize
    except (TypeError, ValueError):
        return None


class _HostDepth(threading.local):
    """Depth of ``host_allocations`` blocks on this thread (a class default: reading it on a
    thread that never entered one costs no failed attribute lookup)."""

    depth = 0


class _StorageRef(weakref.ref):
    """A weak reference to a charged storage that remembers its key (cheaper per allocation
    than ``weakref.finalize``, which the tracker paid on about half of a step's ops)."""

    __slots__ = ("key",)


class SimMemory(Memory):
    backend_name = "cpu_sim"

    def __init__(self, device) -> None:
        self.device = device
        self._counters = [_Counters() for _ in range(device.device_count())]
        self._charged: dict[int, tuple[int, int]] = {}
        """storage key -> (device index, bytes charged)"""
        self._refs: dict[int, _StorageRef] = {}
        """storage key -> the weak reference whose callback credits it back"""
        self._lock = threading.RLock()
        self._mode: _Tracker | None = None
        self._current = 0  # the device set_device bound this process to
        self._host = _HostDepth()  # depth of host_allocations blocks on this thread
        device.on_set_device(self._bind)
        device.on_release(self._unbind)

    # --- accounting ----------------------------------------------------------
    def _bind(self, index: int) -> None:
        self._current = index
        if self._mode is None:
            self._mode = _Tracker(self)
            self._mode.__enter__()  # active until the process releases its device
            self._wrap_storage_resize()

    def _unbind(self) -> None:
        """The process released its device: stop seeing every aten op (a run that trained in
        the caller's process must not leave a dispatch mode behind: it slows everything after
        it and breaks torch's own tensor subclasses, e.g. ``causal_lower_right``). Storages
        already charged are still credited back when torch frees them."""
        if self._mode is None or _get_current_dispatch_mode() is not self._mode:
            return  # not installed, or a mode entered after it is still on top: leave the stack alone
        self._mode.__exit__(None, None, None)
        self._mode = None
        torch.UntypedStorage.resize_ = self._unwrapped_resize

    def _wrap_storage_resize(self) -> None:
        previous = torch.UntypedStorage.resize_
        self._unwrapped_resize = previous
        memory = self

        def resize_(storage, size):
            entry = memory._charged.get(storage._cdata)
            if entry is None:
                return previous(storage, size)
            memory._resize(storage._cdata, int(size), check=True)
            try:
                return previous(storage, size)
            except BaseException:
                memory._resize(storage._cdata, entry[1], check=False)
                raise

        resize_.__doc__ = previous.__doc__
        torch.UntypedStorage.resize_ = resize_

    def _resize(self, key: int, new: int, check: bool) -> None:
        with self._lock:
            entry = self._charged.get(key)
            if entry is None:
                return
            idx, old = entry
            c = self._counters[idx]
            grow = _round(new) - _round(old)
            if check and grow > 0:
                self._check_capacity_locked(idx, new - old, need=grow)
            self._charged[key] = (idx, new)
            c.allocated += new - old
            c.active += grow
            c.cached = max(0, c.cached - grow) if grow > 0 else c.cached - grow
            self._peaks(c)

    def _charge(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s._cdata
        n = s.nbytes()
        entry = self._charged.get(key)
        if entry is not None:
            if entry[1] != n:  # resized by an op since we last saw it
                self._resize(key, n, check=True)
            return
        idx = self._current
        c = self._counters[idx]
        need = (n + BLOCK - 1) // BLOCK * BLOCK
        with self._lock:
            if c.active + need > self.device._profile.memory:  # the attribute: no property call per op
                self._check_capacity_locked(idx, n)
            self._charged[key] = (idx, n)
            c.allocated += n
            c.active += need
            cached = c.cached - need
            c.cached = cached if cached > 0 else 0
            if c.allocated > c.peak_allocated:
                c.peak_allocated = c.allocated
            if c.active > c.peak_active:
                c.peak_active = c.active
            if c.active + c.cached > c.peak_reserved:
                c.peak_reserved = c.active + c.cached
        ref = _StorageRef(s, self._freed)
        ref.key = key
        self._refs[key] = ref

    def _freed(self, ref: _StorageRef) -> None:
        key = ref.key
        self._refs.pop(key, None)
        with self._lock:  # credited back (this runs for about half of a step's ops)
            entry = self._charged.pop(key, None)
            if entry is None:
                return
            idx, n = entry
            c = self._counters[idx]
            need = (n + BLOCK - 1) // BLOCK * BLOCK
            c.allocated -= n
            c.active -= need
            c.cached += need

    @staticmethod
    def _peaks(c: _Counters) -> None:
        c.peak_allocated = max(c.peak_allocated, c.allocated)
        c.peak_active = max(c.peak_active, c.active)
        c.peak_reserved = max(c.peak_reserved, c.reserved)

    def _check_capacity(self, n: int) -> None:
        with self._lock:
            self._check_capacity_locked(self._current, n)

    def _check_capacity_locked(self, idx: int, n: int, need: int | None = None) -> None:
        c = self._counters[idx]
        need = _round(n) if need is None else need
        cap = self.device.profile.memory
        if c.active + need <= cap:
            return
        c.cached = 0  # flush the cache and retry, as a caching allocator does
        if c.active + need > cap:
            raise OutOfMemoryError(
                f"cpu_sim device {idx} is out of memory. Tried to allocate {n} bytes "
                f"({need} after {BLOCK}-byte rounding); {c.allocated} bytes allocated, "
                f"capacity {cap} bytes (profile {self.device.profile.name}). Free tensors, "
                "reduce the micro-batch, or choose a larger CHIPSET_SIM_PROFILE.",
                device=f"cpu_sim:{idx}",
                requested_bytes=n,
            )

    # --- the interface ---------------------------------------------------------
    def _index(self, index: int | None) -> int:
        return self.device._check_index(self.device.current_device() if index is None else index)

    def stats(self, index: int | None = None) -> MemoryStats:
        c = self._counters[self._index(index)]
        with self._lock:
            return MemoryStats(c.allocated, c.reserved, c.active, c.peak_allocated, c.peak_reserved, c.peak_active)

    def reset_peak_stats(self, index: int | None = None) -> None:
        c = self._counters[self._index(index)]
        with self._lock:
            c.peak_allocated, c.peak_active, c.peak_reserved = c.allocated, c.active, c.reserved

    def empty_cache(self) -> None:
        with self._lock:
            for c in self._counters:
                c.cached = 0

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        c = self._counters[self._index(index)]
        cap = self.device.profile.memory
        return cap - c.reserved, cap

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        # The host is the device: a plain copy is what pinning would give.
        return tensor.clone()

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Tensors created inside are host memory: never charged to the simulated device (nor
        credited back when freed). Per thread, nestable."""
        self._host.depth += 1
        try:
            yield
        finally:
            self._host.depth -= 1
