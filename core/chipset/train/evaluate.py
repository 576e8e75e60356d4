"""Evaluation on held-out data every ``train.eval_every`` steps: loss and perplexity.

The forward runs through the same parallel engine as training (ZeRO-3 units gather and
release on their own hooks), under ``torch.no_grad``, on ``train.eval_steps`` batches of
``train.global_batch`` held-out samples (the family's ``eval_data``) split over dp ranks and
micro-batches exactly like training batches. Each metric of the family's ``eval_metrics`` (the
loss; for a classifier also accuracy) is averaged over micro-batches and dp ranks and logged as
``eval_<name>``. The built-in decoder's loss is the language-model cross-entropy alone (a MoE
model's load-balancing term is left out), so ``exp(loss)`` is the perplexity (``eval_ppl``, for
token families). Eval batch ``i`` is the same at every evaluation, so evaluations of one run are
comparable.
"""

from __future__ import annotations

import logging
import math

import torch

from chipset.runtime.precision import compute_input

log = logging.getLogger(__name__)


def eval_shortfall(cfg, data) -> str | None:
    """A warning when one evaluation asks for more sequences (``train.eval_steps`` x
    ``train.global_batch``) than the held-out data has windows: the windows repeat, so the eval
    loss weighs some of them twice and is no better an estimate than ``windows`` alone."""
    windows = getattr(data, "windows", None)  # a held-out token part; synthetic data has no end
    want = cfg.train.eval_steps * cfg.train.global_batch
    if windows is None or windows >= want:
        return None
    fits = max(1, windows // cfg.train.global_batch)
    return (f"evaluation: train.eval_steps ({cfg.train.eval_steps}) x train.global_batch ({cfg.train.global_batch}) "
            f"= {want} sequences, but the held-out data has {windows} window(s) of train.seq_len + 1 tokens, so "
            f"windows repeat within one evaluation; set train.eval_steps = {fits} or hold out more "
            "(data.eval_fraction, data.eval_path)")


class Evaluator:
    def __init__(self, cfg, engine, dims, col, rank: int, family):
        self.cfg, self.engine, self.col, self.family = cfg, engine, col, family
        self.every, self.steps = cfg.train.eval_every, cfg.train.eval_steps
        self.data = family.eval_data(cfg)
        self.per_token = family_unit(family, cfg) == "tokens"
        self.dp_rank, self.dp = dims.coords(rank)["dp"], dims.dp
        if rank == 0 and (short := eval_shortfall(cfg, self.data)):
            log.warning(short)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.cfg.train.steps

    @torch.no_grad()
    def run(self) -> dict:
        e, mbs = self.engine, self.cfg.parallel.micro_batches
        model = e.model
        was_training = model.training
        model.eval()
        names: list[str] = []
        total = None
        try:
            for i in range(self.steps):
                for m in range(mbs):
                    inputs, targets = self.data.batch(i, self.dp_rank, self.dp, m, mbs, device=e.device)
                    got = self.family.eval_metrics(model, compute_input(inputs, e.dtype), targets)
                    if total is None:
                        names = sorted(got)
                        total = torch.zeros(len(names), dtype=torch.float64, device=e.device)
                    total += torch.stack([got[k].detach().double().reshape(()) for k in names])
        finally:
            model.train(was_training)
        total /= self.steps * mbs
        if e.dp > 1:
            self.col.all_reduce(total, "sum", group=e.group)
            total /= e.dp
        out = {f"eval_{k}": float(v) for k, v in zip(names, total.tolist(), strict=True)}
        if self.per_token:  # perplexity of a per-token cross-entropy
            out["eval_ppl"] = math.exp(out["eval_loss"]) if out["eval_loss"] < 700 else float("inf")
        return out


def family_unit(family, cfg) -> str:
    """``"tokens"`` or ``"samples"``: what ``family.throughput`` counts (a duck-typed family
    without it: tokens)."""
    own = getattr(family, "throughput", None)
    return own(cfg)[0] if callable(own) else "tokens"
