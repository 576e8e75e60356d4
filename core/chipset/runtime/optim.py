"""Optimizers the data-parallel engine injects into its buckets: AdamW and SGD with momentum.

An optimizer updates one flat float32 master tensor from its gradient, keeping per-element
state tensors of the same shape. It declares their names (``state_names``): the engine
allocates one zero tensor per name for what each rank owns (ZeRO shards it like the master),
checkpoints store each as ``optim.<name>.<parameter>`` (train/checkpoint/layout.py derives the
kinds from these names), and the planner's memory estimate of a run counts ``len(state_names)``
float32 values per parameter (planner/run.py, ``optimizer_bytes``). An optimizer never communicates: the engine hands it the reduced, clipped and
unscaled gradient of the slice this rank owns.

To add one: a class with ``name``, ``state_names`` and ``update(master, grad, state, step, lr,
kernels)`` that changes ``master`` and ``state`` in place, then an entry in :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["OPTIMIZERS", "AdamW", "Optimizer", "SGD", "make_optimizer"]


class Optimizer(Protocol):
    """What the engine needs from an optimizer."""

    name: str
    state_names: tuple[str, ...]

    def update(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int,
               lr: float, kernels) -> None:
        """Update ``master`` (float32) in place from ``grad`` (float32, same shape) at 1-based ``step``."""


@dataclass(frozen=True)
class AdamW:
    """AdamW (Loshchilov & Hutter) with decoupled weight decay, through ``kernels.fused_adamw``
    (the backend's fused kernel when it has one, else the reference)."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: str = "adamw"
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def update(self, master, grad, state, step, lr, kernels) -> None:
        kernels.fused_adamw([master], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], step, lr=lr,
                            beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class SGD:
    """SGD with heavy-ball momentum (torch.optim.SGD's form: ``buf = m * buf + g``, the first
    step ``buf = g``), optional Nesterov, and decoupled weight decay (``w -= lr * wd * w``, as
    AdamW decays). One state tensor (``momentum``) instead of AdamW's two; none at momentum 0."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    name: str = "sgd"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def update(self, master, grad, state, step, lr, kernels) -> None:
        if self.weight_decay:
            master.mul_(1.0 - lr * self.weight_decay)
        if not self.momentum:
            master.add_(grad, alpha=-lr)
            return
        buf = state["momentum"]
        if step == 1:
            buf.copy_(grad)
        else:
            buf.mul_(self.momentum).add_(grad)
        master.add_(grad.add(buf, alpha=self.momentum) if self.nesterov else buf, alpha=-lr)


OPTIMIZERS = {"adamw": AdamW, "sgd": SGD}
"""``train.optimizer`` name -> optimizer class (declared once: the config validates against it)."""


def make_optimizer(train) -> Optimizer:
    """The optimizer a run's ``[train]`` table asks for (``train.optimizer`` and its hyperparameters)."""
    if train.optimizer == "sgd":
        return SGD(momentum=train.momentum, nesterov=train.nesterov, weight_decay=train.weight_decay)
    return AdamW(beta1=train.beta1, beta2=train.beta2, eps=train.eps, weight_decay=train.weight_decay)
