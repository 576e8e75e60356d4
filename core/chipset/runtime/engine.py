"""The one protocol both engines implement: :class:`chipset.runtime.data_parallel.DataParallel`
(dp, ZeRO 0-3, tp, cp, ep) and :class:`chipset.runtime.pipeline.engine.PipelineEngine` (pp, with a
DataParallel over each stage). The training loop, checkpoints, evaluation and ``chipset.api``
talk to an engine only through this surface.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Engine"]


@runtime_checkable
class Engine(Protocol):
    """A model wrapped for training under a layout."""

    model: nn.Module
    """This rank's share of the model (a pipeline engine: its stages)."""
    device: torch.device
    dtype: torch.dtype
    """The compute dtype of the parameters."""
    micro_batches: int
    """Micro-batches per optimizer step."""
    step_count: int
    """Optimizer steps taken (a checkpoint restores it)."""

    def forward_backward_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                              loss_factor: float = 1.0) -> list[float]:
        """Forward and backward of a step's micro-batches (``(inputs, targets)`` each, this
        rank's share); gradients reduced as the layout says. Returns the micro-batch losses.
        ``loss_factor`` multiplies every micro-batch's loss before backward (returned losses
        included): 1.0 but for a fault a backend injects (``Collective.loss_factor``)."""

    def step(self, lr: float) -> dict[str, Any]:
        """Finish gradient communication, unscale, clip and update at ``lr``: ``grad_norm``,
        ``skipped``, ``loss_scale``."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state under this layout (checkpoints reshard through
        train/checkpoint/layout.py instead)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output written under the same layout."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter unsharded, float32 on the host, by single-process name (collective;
        holds the whole model: small models and tests)."""

    def params_digest(self) -> str:
        """The layout-independent digest of the whole model, hashed shard by shard (collective)."""

    def param_hashes(self) -> dict[str, bytes]:
        """Name -> per-parameter hash (runtime/digest.py) of the whole model (collective)."""

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters unsharded one bucket at a time (collective)."""
