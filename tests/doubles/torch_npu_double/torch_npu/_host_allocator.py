"""TEST DOUBLE: account host tensors as NPU memory, for whole-process runs with host placement.

Active only with TORCH_NPU_DOUBLE_PLACE_ON_HOST=1 (a subprocess running a whole suite),
from the first device call on. Like torch_npu's caching allocator: each new storage
is charged to the current NPU in 512-byte blocks, freed bytes stay reserved until
empty_cache, and an allocation past the capacity raises the allocator's OOM (the
host allocation it shadowed is dropped, so the device stays usable).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_npu import _double

BLOCK = 512
_seen: set[int] = set()


def _charge(t: torch.Tensor, index: int) -> None:
    s = t.untyped_storage()
    key = s._cdata
    if key in _seen or s.nbytes() == 0:
        return
    nbytes = (s.nbytes() + BLOCK - 1) // BLOCK * BLOCK
    _double.allocate(nbytes, index)  # raises the NPU OOM past the capacity
    _seen.add(key)
    weakref.finalize(s, _release, key, nbytes, index)


def _release(key: int, nbytes: int, index: int) -> None:
    _seen.discard(key)
    _double.free(nbytes, index)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch_npu import npu

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                _charge(t, npu.current_device())
        return out


_mode: _Mode | None = None


def activate() -> None:
    global _mode
    if _mode is None:
        _mode = _Mode()
        _mode.__enter__()  # for the life of the process
