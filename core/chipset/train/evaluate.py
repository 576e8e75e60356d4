"""Evaluation on held-out data every ``train.eval_every`` steps: loss and perplexity.

The forward runs through the same parallel engine as training (ZeRO-3 units gather and
release on their own hooks), under ``torch.no_grad``, on ``train.eval_steps`` batches of
``train.global_batch`` held-out sequences split over dp ranks and micro-batches exactly like
training batches. The loss is the language-model cross-entropy alone (a MoE model's
load-balancing term is left out), averaged over micro-batches and dp ranks, so
``exp(loss)`` is the perplexity. Eval batch ``i`` is the same at every evaluation, so
evaluations of one run are comparable.
"""

from __future__ import annotations

import math

import torch

from chipset.runtime.precision import compute_input


class Evaluator:
    def __init__(self, cfg, engine, dims, col, rank: int):
        from chipset.data.datasets import make_eval_dataset

        self.cfg, self.engine, self.col = cfg, engine, col
        self.every, self.steps = cfg.train.eval_every, cfg.train.eval_steps
        self.data = make_eval_dataset(cfg)
        self.dp_rank, self.dp = dims.coords(rank)["dp"], dims.dp

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.cfg.train.steps

    @torch.no_grad()
    def run(self) -> dict:
        e, mbs = self.engine, self.cfg.parallel.micro_batches
        model = e.model
        was_training = model.training
        model.eval()
        total = torch.zeros(1, dtype=torch.float64, device=e.device)
        try:
            for i in range(self.steps):
                for m in range(mbs):
                    tokens, targets = self.data.batch(i, self.dp_rank, self.dp, m, mbs, device=e.device)
                    total += model.loss(compute_input(tokens, e.dtype), targets, aux=False).double()
        finally:
            model.train(was_training)
        total /= self.steps * mbs
        if e.dp > 1:
            self.col.all_reduce(total, "sum", group=e.group)
            total /= e.dp
        loss = float(total)
        return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else float("inf")}
