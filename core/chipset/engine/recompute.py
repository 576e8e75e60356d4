"""Activation recompute, applied to a model as data (``none`` | ``selective`` | ``full``)."""

from __future__ import annotations

from torch import nn

from chipset.config import RECOMPUTE
from chipset.errors import ConfigError

__all__ = ["apply_recompute"]


def apply_recompute(model: nn.Module, *, mode: str) -> None:
    """``selective``: recompute the attention core (scores, softmax) in backward;
    ``full``: recompute each transformer block; ``none``: keep every activation."""
    if mode not in RECOMPUTE:
        raise ConfigError(f"recompute = {mode!r}: expected one of {', '.join(RECOMPUTE)}")
    model.recompute = mode
    for m in model.modules():
        if hasattr(m, "recompute_core"):
            m.recompute_core = mode == "selective"
