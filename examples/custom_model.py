"""Bring your own model: a small MLP classifier trained by ``chipset train`` (docs/models.md).

Run it from the repository root::

    PYTHONPATH=examples chipset train examples/custom-model.toml --nproc 2

``model.family = "custom_model:family"`` in the config makes chipset import this file and call
``family()``; nothing here is packaged or registered.
"""

from __future__ import annotations

import torch
from torch import nn

from chipset.models.family import ModelFamily, classifier_metrics


class MLP(nn.Module):
    """Two blocks of Linear -> GELU -> Linear with a residual, then a classifier."""

    def __init__(self, features: int, hidden: int, classes: int, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                                  nn.Linear(hidden, features)) for _ in range(blocks))
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:  # ZeRO-3 gathers one block at a time
        return [*self.blocks, self.head]


class Gaussians:
    """Synthetic classification data: sample ``i`` is the same on every layout."""

    def __init__(self, features: int, classes: int, global_batch: int, seed: int, offset: int = 0):
        self.features, self.global_batch, self.seed, self.offset = features, global_batch, seed, offset
        self.teacher = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed))

    def sample(self, i: int) -> torch.Tensor:
        return torch.randn(self.features, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + i))

    def batch(self, step, dp_rank=0, dp=1, micro=0, micro_batches=1, device=None):
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = self.offset + step * self.global_batch + dp_rank * per_rank + micro * mb
        x = torch.stack([self.sample(first + j) for j in range(mb)])
        y = (x @ self.teacher.T).argmax(dim=-1)
        return (x.to(device), y.to(device)) if device is not None else (x, y)


class MLPFamily(ModelFamily):
    name = "mlp"
    layouts = frozenset({"dp", "zero1", "zero2", "zero3", "tp"})
    # Megatron-style MLP split: the first Linear of each block by output, the second by input.
    tp_plan = {"blocks.*.0": "colwise", "blocks.*.2": "rowwise", "head": "replicated"}

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 8):
        self.features, self.hidden, self.classes = features, hidden, classes

    def build(self, cfg) -> nn.Module:
        return MLP(self.features, self.hidden, self.classes)

    def data(self, cfg):
        return Gaussians(self.features, self.classes, cfg.train.global_batch, cfg.data.seed)

    def eval_data(self, cfg):  # train.eval_every: samples no training step draws
        return Gaussians(self.features, self.classes, cfg.train.global_batch, cfg.data.seed, offset=1 << 30)

    def eval_metrics(self, model, inputs, targets):  # eval_loss and eval_accuracy
        return classifier_metrics(self, model, inputs, targets)

    def flops_per_sample(self, cfg) -> float:
        per_block = 2 * 2 * self.features * self.hidden
        return 3.0 * (2 * per_block + 2 * self.features * self.classes)  # forward + 2x backward


def family() -> MLPFamily:
    return MLPFamily()
