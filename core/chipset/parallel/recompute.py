"""Activation recompute (``none`` | ``selective`` | ``full``), applied by the model's family."""

from __future__ import annotations

from torch import nn

from chipset.errors import ConfigError

__all__ = ["RECOMPUTE", "apply_recompute"]

RECOMPUTE = ("none", "selective", "full")
"""Recompute modes, declared once (the config, the planner and the families read them here)."""


def apply_recompute(model: nn.Module, *, mode: str, family) -> None:
    """Make ``model`` recompute in backward as ``mode`` says, through ``family.apply_recompute``
    (chipset.models.family): ``selective`` recomputes the
    attention core, ``full`` each block, ``none`` keeps every activation."""
    if mode not in RECOMPUTE:
        raise ConfigError(f"recompute = {mode!r}: expected one of {', '.join(RECOMPUTE)}")
    apply = getattr(family, "apply_recompute", None)  # a duck-typed family without it has none
    if apply is not None:
        apply(model, mode)
