"""Every linear layer's product through the backend's ``linear`` kernel (``x W^T + b``, kernels/reference.py).

A layer whose product chipset chooses is a :class:`RoutedLinear`: its ``product`` (``(x, w, b=None)
-> x w^T + b``) is a declared attribute, given to its constructor and changed only through
:meth:`RoutedLinear.route`. Chipset's own linears are routed ones: :class:`KernelLinear` and the
tensor-parallel column and row linears (parallel/tensor.py).

:func:`apply_linear` runs when the engine builds a model, after the tensor-parallel plan and before
LoRA and FP8. It swaps modules, never patches one: each plain ``nn.Linear`` child is replaced in
its parent by a new :class:`KernelLinear` (:meth:`KernelLinear.replacing`) holding the very same
Parameter objects (so parameter names, identity, tied weights, buckets and checkpoints are
unchanged) and whatever else the layer held (children, buffers, its hook dictionaries, so a
handle the user kept still removes its hook); the user's ``nn.Linear`` itself keeps its class and
gains no attribute. LoRA then adds its adapters to the swapped layer and FP8 re-routes its
projections. The kernel is resolved once per model (``KernelRegistry.resolve``), so a forward
calls the backend's function directly, with no registry lookup per call; with nothing registered
that is ``F.linear``, what ``nn.Linear`` calls.

Precedence: FP8 replaces ``linear`` where it is on. The projections ``train.fp8`` routes compute
their product with ``fp8_matmul`` (a GEMM of its own, certified on its own) and keep it; the
layers FP8 leaves in the run's dtype (the vocabulary head, the MoE router) go through ``linear``.
LoRA's adapters (``apply_lora(linear=...)``) go through it too. Subclasses of ``nn.Linear`` that
transform their input first (ResNet's pooled head) are not ``x W^T + b`` and are left as they are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KernelLinear", "Product", "RoutedLinear", "apply_linear", "routable"]

Product = Callable[..., torch.Tensor]
"""A linear layer's product, ``(x, weight, bias=None) -> x weight^T + bias`` (``F.linear``'s signature)."""


class RoutedLinear(nn.Module):
    """A linear layer whose product chipset chooses when it builds the model.

    ``product`` is ``F.linear`` until routed: the backend's ``linear`` kernel (:func:`apply_linear`),
    ``fp8_matmul`` where ``train.fp8`` replaces it (parallel/fp8.py)."""

    product: Product
    """What :meth:`forward` computes ``x W^T (+ b)`` with (subclasses set it in ``__init__``)."""

    def route(self, product: Product) -> None:
        """Compute this layer's product with ``product`` from now on."""
        self.product = product

    @property
    def routed(self) -> bool:
        """Whether a product other than the reference ``F.linear`` was given (routing one to
        ``F.linear`` changes nothing, so it needs no mark of its own)."""
        return self.product is not F.linear


class KernelLinear(RoutedLinear, nn.Linear):
    """An ``nn.Linear`` whose product is :attr:`~RoutedLinear.product`: the backend's ``linear``
    kernel, ``fp8_matmul`` under ``train.fp8``. Built like ``nn.Linear`` plus ``product``, or
    from a user's layer with :meth:`replacing`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 product: Product = F.linear):
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self.product = product

    @classmethod
    def replacing(cls, mod: nn.Linear, product: Product) -> KernelLinear:
        """A :class:`KernelLinear` to stand in ``mod``'s place, computing its product with ``product``.

        It holds ``mod``'s very Parameter objects, buffers and children (in containers of its own,
        so ``mod`` is left as it was) and shares its hook dictionaries (a handle from
        ``mod.register_forward_hook`` removes the hook from both). Built without ``__init__``:
        ``nn.Linear``'s would allocate and initialise weights (drawing from torch's generator)
        only for them to be dropped."""
        new = cls.__new__(cls)
        state = dict(vars(mod))
        for own in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            state[own] = copy.copy(state[own])
        vars(new).update(state)
        new.product = product
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


def _swapped(mod: nn.Module, product: Product, made: dict[int, KernelLinear]) -> nn.Module:
    """``mod``, or the :class:`KernelLinear` standing in for it where it is a plain ``nn.Linear``
    (one per layer: a layer held under two names stays one module)."""
    if type(mod) is not nn.Linear:
        return mod
    if id(mod) not in made:
        made[id(mod)] = KernelLinear.replacing(mod, product)
    return made[id(mod)]


def apply_linear(model: nn.Module, kernels) -> nn.Module:
    """Route every linear layer of ``model`` through ``kernels``' ``linear`` kernel: each plain
    ``nn.Linear`` child swapped for a :class:`KernelLinear`, each :class:`RoutedLinear` not routed
    yet (``train.fp8``'s projections are) given the kernel. Returns the model: ``model`` itself,
    or its stand-in where ``model`` is a plain ``nn.Linear``."""
    fn = kernels.resolve("linear")
    made: dict[int, KernelLinear] = {}
    # Innermost first: a layer's children are swapped before the layer is copied.
    for parent in reversed(list(model.modules())):
        if isinstance(parent, RoutedLinear) and not parent.routed:
            parent.route(fn)
        for leaf, child in list(parent._modules.items()):
            new = child if child is None else _swapped(child, fn, made)
            if new is not child:
                setattr(parent, leaf, new)
    return _swapped(model, fn, made)


def routable(model: nn.Module, name: str) -> RoutedLinear:
    """``model``'s submodule ``name`` as a :class:`RoutedLinear`: a plain ``nn.Linear`` is swapped
    for a :class:`KernelLinear` (``F.linear`` until routed) in its parent first. TypeError for
    any other module."""
    mod = model.get_submodule(name)
    if isinstance(mod, RoutedLinear):
        return mod
    if type(mod) is not nn.Linear or not name:
        what = "the model itself" if not name else type(mod).__name__
        raise TypeError(f"{name or 'model'}: {what} is not a linear layer chipset routes (a plain nn.Linear "
                        "child, a KernelLinear, a tensor-parallel column or row linear)")
    parent, _, leaf = name.rpartition(".")
    new = KernelLinear.replacing(mod, F.linear)
    setattr(model.get_submodule(parent), leaf, new)
    return new
