"""Activation recompute (``none`` | ``selective`` | ``full``), applied by the model's family."""

from __future__ import annotations

from torch import nn

from chipset.config import RECOMPUTE
from chipset.errors import ConfigError

__all__ = ["apply_recompute"]


def apply_recompute(model: nn.Module, *, mode: str, family=None) -> None:
    """Make ``model`` recompute in backward as ``mode`` says, through ``family.apply_recompute``
    (chipset.models.family; default: the built-in transformer's): ``selective`` recomputes the
    attention core, ``full`` each block, ``none`` keeps every activation."""
    if mode not in RECOMPUTE:
        raise ConfigError(f"recompute = {mode!r}: expected one of {', '.join(RECOMPUTE)}")
    if family is None:
        from chipset.models.family import TransformerFamily

        family = TransformerFamily()
    apply = getattr(family, "apply_recompute", None)  # a duck-typed family without it has none
    if apply is not None:
        apply(model, mode)
