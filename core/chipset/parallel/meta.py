"""Building a model on the meta device (shapes and names, no memory), without its initialisers.

Every process of a job builds one: the launcher to check the layout, each rank to count
parameters or to shard before it loads weights. A meta tensor holds no data, so an in-place
random initialiser on it (``nn.init.normal_`` and the like) does nothing; torch nevertheless runs
it through its Python reference, whose first call imports ``torch._dynamo``, ``torch._inductor``,
sympy and triton: 1.8 s of CPU on an idle core (3-5 s on a busy one) per process, more than the
rest of a small job's start-up. :func:`on_meta` skips those calls on meta tensors only; they
consume no random numbers (the generator's state is the same either way), so nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["on_meta"]

# torch.nn.init's in-place functions (each dispatches as itself, so a mode sees them before the
# tensor methods they call) and the in-place random tensor methods.
_INITIALISERS = frozenset(
    [getattr(torch.nn.init, name) for name in dir(torch.nn.init)
     if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name))]
    + [getattr(torch.Tensor, name) for name in ("normal_", "uniform_", "erfinv_", "exponential_", "random_",
                                               "bernoulli_", "cauchy_", "log_normal_", "geometric_")])


class _SkipMetaInitialisers(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor  # what the in-place call returns: the tensor, unchanged
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``with torch.device("meta"):`` with in-place random initialisers of meta tensors skipped."""
    with torch.device("meta"), _SkipMetaInitialisers():
        yield
