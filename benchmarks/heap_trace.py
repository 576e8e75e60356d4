"""Where a step's minor page faults and glibc heap trims happen, operator by operator (Linux, glibc).

``heap_trace(fn, first, steps)`` runs ``fn(i)`` for ``steps`` steps under a
``TorchDispatchMode`` that reads, around every aten operator, the calling thread's minor page
faults (``getrusage(RUSAGE_THREAD)``) and glibc's heap size (``mallinfo2().arena``). It
reports the faults per step, the operators whose own work faulted most (by name and first
input's shape: a fresh output written into pages the kernel has to supply), and every heap
trim (the heap shrinking: a ``free`` gave its top back to the kernel), with where it happened:
inside an operator, or between two (a tensor freed by Python), and the Python frames at that
point. Used by ``pp_vs_torch_pipelining.py --heap-trace``.
"""

from __future__ import annotations

import collections
import ctypes
import os
import resource
import traceback

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes():
    """A function returning glibc's heap size in bytes (``mallinfo2().arena``), or None off glibc."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return lambda: fn().arena


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _where(keep: tuple[str, ...] = ("chipset", "pipelining", "benchmarks")) -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if any(k in f.filename for k in keep)]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-3:]))


class _Trace(TorchDispatchMode):
    def __init__(self, heap) -> None:
        super().__init__()
        self.heap = heap
        self.op_faults: collections.Counter = collections.Counter()
        self.trims: list[tuple[int, str, str]] = []
        self.last_heap = heap()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        h0 = self.heap()
        if h0 < self.last_heap:
            self.trims.append((self.last_heap - h0, f"before {func}", _where()))
        f0 = _faults()
        out = func(*args, **(kwargs or {}))
        f1, h1 = _faults(), self.heap()
        if f1 > f0:
            self.op_faults[(str(func), tuple(getattr(args[0], "shape", ()) if args else ()))] += f1 - f0
        if h1 < h0:
            self.trims.append((h0 - h1, f"inside {func}", _where()))
        self.last_heap = h1
        return out


def heap_trace(fn, first: int, steps: int = 3, barrier=None) -> dict:
    """``steps`` steps of ``fn`` traced as the module docstring says (``barrier()`` before each)."""
    heap = _heap_bytes()
    if heap is None:
        return {"error": "needs glibc (mallinfo2)"}
    faults, op_faults, trims = [], collections.Counter(), []
    for i in range(first, first + steps):
        if barrier is not None:
            barrier()
        mode = _Trace(heap)
        f0 = _faults()
        with mode:
            fn(i)
        faults.append(_faults() - f0)
        op_faults.update(mode.op_faults)
        trims += mode.trims
    return {"minor_faults_per_step": faults,
            "top_faulting_ops": [[f"{name} {list(shape)}", n] for (name, shape), n in op_faults.most_common(6)],
            "heap_trims": [[kib >> 10, when, where] for kib, when, where in trims]}
