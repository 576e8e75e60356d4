"""What the model did in a step, beside time and memory: for ``chipset diagnose``.

- MoE routing load (``moe`` in metrics.jsonl): each MoE layer counts its router's choices per
  expert (before capacity dropping) and its dropped assignments
  (:attr:`chipset.layers.moe.MoE.load`); one all-reduce per step sums them over the ranks
  (slots for every MoE layer of the model, zeros where a pipeline stage holds none) and rank 0
  keeps per layer ``max_over_mean`` (the busiest expert's choices over the mean per expert),
  ``top_expert`` (that expert), ``dropped_share`` (dropped / all choices) and ``choices`` (all
  router choices of the step, top_k per token, summed over ranks) of ``experts``. Ratios, so
  counting a forward twice (activation recompute) or once per tensor-parallel rank leaves them
  as they are (``choices`` then counts each token that many times).
- Replica checksum (``param_sum``, one number per rank, every ``train.replica_check_every``
  steps): the sum of this rank's local parameters, each summed on the device with float32
  accumulation (no copy of the parameter), then added in float64: one read of the parameters. Data-parallel replicas hold bit-identical parameters, so ranks that hold
  the same part of the model record the same number; a different one means a replica diverged.
  Not computed where no rank has a replica (``ParallelDims.dp_replicas``: one process, pp, tp or
  cp without dp) nor under ZeRO-3 (no rank holds whole parameters): there is nothing to compare.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from chipset.layers.moe import MoE, is_moe_layer


class ModelStats:
    """One rank's model-side step numbers (see the module docstring)."""

    def __init__(self, cfg, dims, model: torch.nn.Module | None) -> None:
        m = cfg.model
        self.num_experts = int(getattr(m, "num_experts", 0) or 0)
        layers = int(getattr(m, "num_hidden_layers", 0) or 0) if self.num_experts > 1 else 0
        self.moe_layers = [i for i in range(layers) if is_moe_layer(m, i)]
        """Every MoE layer of the model (block indices), on every rank."""
        mods = [x for x in model.modules() if isinstance(x, MoE)] if model is not None else []
        self.moe = [x for x in mods if x.layer in self.moe_layers]
        # Nothing to compare where no rank has a replica (one process; pp, tp or cp without dp): no
        # read of the parameters and no sync with the device for a number nobody checks. One decision
        # for all ranks: the record keeps param_sum by rank 0's number.
        replicated = dims.zero != 3 and any(len(g) > 1 for g in dims.dp_replicas())
        self.every = cfg.train.replica_check_every if replicated else 0
        self.params = [p for p in model.parameters()] if model is not None and self.every else []

    def begin_step(self) -> None:
        for x in self.moe:
            x.reset_load()

    def param_sum(self, step: int) -> float:
        """This rank's parameter checksum when step ``step`` (1-based) is due, else NaN."""
        if not self.params or step % self.every:
            return math.nan
        with torch.no_grad():
            sums = torch.stack([p.detach().sum(dtype=torch.float32) for p in self.params])  # no float32 copy
            return float(sums.double().sum().item())

    def moe_load(self, collective, device: torch.device, world: int) -> list[dict[str, Any]] | None:
        """Per MoE layer, the step's routing summary over every rank (collective: every rank calls it)."""
        if not self.moe_layers:
            return None
        width = self.num_experts + 1
        vec = torch.zeros(len(self.moe_layers) * width, dtype=torch.float64, device=device)
        for x in self.moe:
            if x.load is not None:
                j = self.moe_layers.index(x.layer) * width
                vec[j:j + width] = x.load.to(vec)
        if world > 1:
            collective.all_reduce(vec, "sum")
        out = []
        for n, layer in enumerate(self.moe_layers):
            row = vec[n * width:(n + 1) * width].tolist()
            load, dropped = row[:-1], row[-1]
            total = sum(load)
            if total <= 0:
                continue
            top = max(range(len(load)), key=lambda e: load[e])
            out.append({"layer": layer, "max_over_mean": load[top] * len(load) / total, "top_expert": top,
                        "dropped_share": dropped / total, "choices": int(total), "experts": len(load)})
        return out
