"""Every linear layer's product through the backend's ``linear`` kernel (``x W^T + b``, kernels/reference.py).

:func:`apply_linear` runs when the engine builds a model, after the tensor-parallel plan, LoRA and
FP8: each ``nn.Linear`` becomes a :class:`KernelLinear` (a subclass: parameters, their names and
hooks stay), and each layer whose product is its ``linear`` attribute (:class:`KernelLinear`,
tensor-parallel column and row linears) calls the kernel. The kernel is resolved once per model
(``KernelRegistry.resolve``), so a forward calls the backend's function directly, with no registry
lookup per call; with nothing registered that is ``F.linear``, what ``nn.Linear`` calls.

Precedence: FP8 replaces ``linear`` where it is on. The projections ``train.fp8`` routes compute
their product with ``fp8_matmul`` (a GEMM of its own, certified on its own) and keep it; the
layers FP8 leaves in the run's dtype (the vocabulary head, the MoE router) go through ``linear``.
LoRA's adapters (``apply_lora(linear=...)``) go through it too. Subclasses of ``nn.Linear`` that
transform their input first (ResNet's pooled head) are not ``x W^T + b`` and are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

from chipset.parallel.tensor import ColumnParallelLinear, RowParallelLinear

__all__ = ["KernelLinear", "apply_linear", "route"]


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose product is ``self.linear`` (``(x, w, b) -> x w^T + b``): the backend's
    ``linear`` kernel once routed (:func:`apply_linear`), ``fp8_matmul`` under ``train.fp8``."""

    linear = staticmethod(F.linear)

    def forward(self, x):
        return self.linear(x, self.weight, self.bias)


ROUTED_TYPES = (KernelLinear, ColumnParallelLinear, RowParallelLinear)
"""The layers whose product is their ``linear`` attribute."""


def route(mod: nn.Module, fn: Callable) -> None:
    """Make ``fn`` the product of ``mod`` (an ``nn.Linear`` or one of :data:`ROUTED_TYPES`)."""
    if type(mod) is nn.Linear:
        mod.__class__ = KernelLinear  # a subclass: parameters, names and hooks (LoRA's) stay
    elif type(mod) not in ROUTED_TYPES:
        raise TypeError(f"{type(mod).__name__} is not a linear layer chipset routes (nn.Linear, "
                        f"{', '.join(t.__name__ for t in ROUTED_TYPES)})")
    mod.linear = fn


def apply_linear(model: nn.Module, kernels) -> list[str]:
    """Route every linear layer of ``model`` through ``kernels``' ``linear`` kernel, except those
    routed already (``train.fp8``'s projections). Returns the routed module names."""
    fn = kernels.resolve("linear")
    names = []
    for name, mod in model.named_modules():
        if (type(mod) is nn.Linear or type(mod) in ROUTED_TYPES) and "linear" not in vars(mod):
            route(mod, fn)
            names.append(name)
    return names
