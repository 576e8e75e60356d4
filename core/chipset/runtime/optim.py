"""Optimizers the data-parallel engine injects into its buckets: AdamW and SGD with momentum.

An optimizer updates one flat float32 master tensor from its gradient, keeping per-element
state tensors of the same shape. It declares their names (``state_names``): the engine
allocates one zero tensor per name for what each rank owns (ZeRO shards it like the master),
checkpoints store each as ``optim.<name>.<parameter>`` (train/checkpoint/layout.py derives the
kinds from these names), stores them in ``state_dtype`` (``train.optimizer_state_dtype``: the
update sees float32 copies, written back rounded), and the planner's memory estimate of a run counts ``len(state_names)``
values of that dtype per parameter (planner/run.py, ``optimizer_bytes``). An optimizer never communicates: the engine hands it the reduced, clipped and
unscaled gradient of the slice this rank owns. One that updates whole matrices (Muon) sets
``uses_matrices``: the engine then also passes ``matrices``, a
:class:`chipset.runtime.matrices.BucketMatrices` that assembles a matrix's full value from
owned slices (the communication stays in the engine's helper).

To add one: a class with ``name``, ``state_names`` and ``update(master, grad, state, step, lr,
kernels)`` that changes ``master`` and ``state`` in place, then an entry in :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["OPTIMIZERS", "STATE_DTYPES", "AdamW", "Muon", "Optimizer", "SGD", "make_optimizer", "newton_schulz"]


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
    state_dtype: torch.dtype = torch.float32

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
    state_dtype: torch.dtype = torch.float32

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


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Muon's quintic Newton-Schulz coefficients (a, b, c): ``X <- a X + (b A + c A^2) X``, ``A = X X^T``."""


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """An approximately orthogonal matrix with ``g``'s singular vectors (``U V^T`` of ``g = U S V^T``,
    singular values pushed into roughly [0.7, 1.2]) by ``steps`` quintic Newton-Schulz iterations,
    in float32 (Muon's authors use bfloat16 on GPUs; float32 keeps layouts bit-comparable)."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.shape[0] > x.shape[1]
    if wide:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if wide else x


@dataclass(frozen=True)
class Muon:
    """Muon (Jordan et al. 2024): momentum SGD whose update of each hidden weight matrix is
    orthogonalised by Newton-Schulz, with AdamW for every other parameter (embeddings, the
    output head, norms, biases: ``runtime/matrices.py``, ``hidden_matrix_names``).

    Matrix ``W`` (logical shape ``A x B``, gathered over ZeRO and tp): ``buf = momentum buf + g``;
    ``u = g + momentum buf`` (Nesterov) or ``buf``; ``W *= 1 - lr wd``;
    ``W -= lr 0.2 sqrt(max(A, B)) NS(u)``. The ``0.2 sqrt(max(A, B))`` factor (Liu et al. 2025,
    "Muon is scalable") gives the update AdamW's typical RMS, so one ``train.lr`` and weight
    decay serve both halves. State: ``exp_avg`` holds Muon's momentum on matrix elements and
    AdamW's first moment elsewhere; ``exp_avg_sq`` is AdamW's second moment (zero on matrix
    elements: the flat state layout is shared with AdamW, so checkpoints and resharding are the same)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: str = "muon"
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    uses_matrices: bool = True
    state_dtype: torch.dtype = torch.float32

    def update(self, master, grad, state, step, lr, kernels, matrices=None) -> None:
        m, v = state["exp_avg"], state["exp_avg_sq"]
        rest = matrices.elementwise if matrices is not None else [(0, master.numel())]
        if rest:
            kernels.fused_adamw([master[a:b] for a, b in rest], [grad[a:b] for a, b in rest],
                                [m[a:b] for a, b in rest], [v[a:b] for a, b in rest], step, lr=lr,
                                beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay)
        if matrices is None or not matrices.gathers:
            return
        u = torch.zeros_like(master)
        for _, a, b, *_ in matrices.entries:
            m[a:b].mul_(self.momentum).add_(grad[a:b])
            u[a:b] = grad[a:b].add(m[a:b], alpha=self.momentum) if self.nesterov else m[a:b]
        for a, b, _, full, put in matrices.full(u):
            o = newton_schulz(full, self.ns_steps)
            master[a:b].mul_(1.0 - lr * self.weight_decay).add_(put(o), alpha=-lr * 0.2 * max(full.shape) ** 0.5)


OPTIMIZERS = {"adamw": AdamW, "sgd": SGD, "muon": Muon}
"""``train.optimizer`` name -> optimizer class (declared once: the config validates against it)."""


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
"""``train.optimizer_state_dtype`` -> the dtype the engine stores optimizer state in. A lighter
state is widened to float32 for the update (one bucket at a time) and rounded back to nearest;
int8 is blockwise-quantised (runtime/int8_state.py)."""


def make_optimizer(train) -> Optimizer:
    """The optimizer a run's ``[train]`` table asks for (``train.optimizer`` and its hyperparameters)."""
    sd = STATE_DTYPES[getattr(train, "optimizer_state_dtype", "float32")]
    if train.optimizer == "muon":
        return Muon(state_dtype=sd, momentum=train.muon_momentum, nesterov=train.muon_nesterov, ns_steps=train.muon_ns_steps,
                    beta1=train.beta1, beta2=train.beta2, eps=train.eps, weight_decay=train.weight_decay)
    if train.optimizer == "sgd":
        return SGD(state_dtype=sd, momentum=train.momentum, nesterov=train.nesterov, weight_decay=train.weight_decay)
    return AdamW(state_dtype=sd, beta1=train.beta1, beta2=train.beta2, eps=train.eps, weight_decay=train.weight_decay)
