"""FP8 training (``train.fp8``): a model's linear projections through the backend's ``fp8_matmul``.

Each projection the family's tensor-parallel plan names (``colwise`` / ``rowwise``, the same
modules LoRA targets by default: attention and MLP projections) computes ``x W^T (+ b)`` with the
``fp8_matmul`` kernel instead of the ``linear`` kernel (FP8 replaces it there: parallel/linear.py):
its operands quantised to FP8 with the scaling ``train.fp8`` names, in the forward and both
backward GEMMs (kernels/fp8.py). The weights, their
gradients and the optimizer stay in the run's dtype (the master copy is never FP8), so
checkpoints are unchanged and a run may switch FP8 on or off between resumes. The embedding, the
vocabulary head, norms and MoE experts stay in the run's dtype, as torchao's and Transformer
Engine's recipes leave them.

A backend runs FP8 only where it declares the scaling in ``Capabilities.fp8`` (conformance
certifies its kernel against the core's emulation); anywhere else ``train.fp8`` is refused
before a run starts.

Under ZeRO-3 with tensorwise scaling (and ``train.fp8_all_gather``, on by default) the engine
gathers these weights in FP8 (runtime/data_parallel.py): while a unit is gathered each such
weight carries its :class:`~chipset.kernels.fp8.Fp8Weight` as the attribute :data:`GATHERED`,
and :class:`Fp8Linear` hands that to ``fp8_matmul`` instead of the weight.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from torch import nn

from chipset.errors import ConfigError
from chipset.kernels.fp8 import FP8_SCALINGS
from chipset.parallel.linear import RoutedLinear, routable
from chipset.parallel.lora import LINEAR_TYPES, default_targets

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["FP8_MODES", "GATHERED", "Fp8Linear", "apply_fp8", "check_fp8", "fp8_targets", "gathered_weights"]

FP8_MODES = ("off", *FP8_SCALINGS)
"""``train.fp8`` values: off, or the FP8 GEMM scaling to train with."""
GATHERED = "chipset_fp8_gathered"
"""The attribute ZeRO-3's FP8 all-gather sets on a weight while its unit is gathered: the
weight's :class:`~chipset.kernels.fp8.Fp8Weight` (absent otherwise)."""


def check_fp8(mode: str, backend: Backend) -> None:
    """ConfigError (exit 2) unless ``backend`` declares FP8 GEMMs with scaling ``mode``."""
    if mode == "off" or mode in backend.capabilities.fp8:
        return
    declared = ", ".join(backend.capabilities.fp8) or "none"
    raise ConfigError(
        f"train.fp8 = {mode!r}: backend {backend.name!r} declares no FP8 GEMM with {mode} scaling "
        f"(Capabilities.fp8: {declared}); set train.fp8 = \"off\", or select a backend that declares it "
        "(cpu_sim emulates both scalings; cuda on compute capability >= 8.9)")


class Fp8Linear:
    """``(x, w, b) -> x w^T + b`` through the ``fp8_matmul`` kernel: what a projection calls in
    place of ``F.linear``."""

    def __init__(self, kernels, scaling: str):
        self.kernels, self.scaling = kernels, scaling

    def __call__(self, x, weight, bias=None):
        gathered = getattr(weight, GATHERED, None)  # ZeRO-3 gathered it in FP8: its bytes, as they are
        y = self.kernels.fp8_matmul(x, weight if gathered is None else gathered, scaling=self.scaling)
        return y if bias is None else y + bias


def fp8_targets(model: nn.Module, family, cfg) -> list[str]:
    """The modules ``train.fp8`` routes: the linear layers the family plan's projection patterns match."""
    patterns = default_targets(family.plan(cfg))
    names = [n for n, m in model.named_modules()
             if type(m) in LINEAR_TYPES and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        raise ConfigError(f"train.fp8 = {cfg.train.fp8!r}: family {cfg.model.family!r} names no linear projections "
                          "in its tensor-parallel plan (colwise/rowwise) for FP8 to route; set train.fp8 = \"off\"")
    return names


def apply_fp8(model: nn.Module, names: list[str], kernels, scaling: str) -> None:
    """Route the modules ``names`` (from :func:`fp8_targets`) through ``kernels.fp8_matmul``: FP8
    replaces the ``linear`` kernel on them (parallel/linear.py, "Precedence"); a plain
    ``nn.Linear`` among them is swapped for a routed one first."""
    linear = Fp8Linear(kernels, scaling)
    for name in names:
        routable(model, name).route(linear)


def gathered_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights ZeRO-3 may all-gather in FP8: those of the layers routed through
    :class:`Fp8Linear` with tensorwise scaling (one scale per weight, which every shard can
    share; a rowwise weight is scaled per row forward but per column for the input gradient,
    so its FP8 bytes would not serve both GEMMs)."""
    out = []
    for mod in model.modules():
        if not isinstance(mod, RoutedLinear):
            continue
        fn = mod.product
        if isinstance(fn, Fp8Linear) and fn.scaling == "tensorwise" and isinstance(mod.weight, nn.Parameter):
            out.append(mod.weight)
    return out
