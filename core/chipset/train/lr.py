"""Learning-rate schedules: linear warm-up, then constant, linear, cosine or warm-up-stable-decay.

``step`` is 0-based (the step about to run). After ``warmup_steps`` the rate goes from
``lr`` to ``min_lr`` over the remaining steps:

- ``constant``: stays at ``lr``;
- ``linear``: falls linearly, reaching ``min_lr`` at the last step;
- ``cosine``: half a cosine, reaching ``min_lr`` at the last step;
- ``wsd`` (warm-up, stable, decay; Hu et al. 2024, "MiniCPM"): stays at ``lr`` and falls
  linearly to ``min_lr`` over the last ``decay_fraction`` of the steps, which lets a run be
  extended from any checkpoint of its stable phase.
"""

from __future__ import annotations

import math


def lr_at(tr, step: int) -> float:
    """The learning rate of 0-based ``step`` for a :class:`chipset.train.config.TrainConfig`."""
    if tr.warmup_steps and step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    schedule = getattr(tr, "lr_schedule", "constant")
    if schedule == "constant":
        return tr.lr
    last = max(tr.steps - 1, tr.warmup_steps)
    if schedule == "wsd":
        decay = max(1, round(tr.decay_fraction * (tr.steps - tr.warmup_steps)))
        begin = last - decay  # the last stable step
        frac = min(1.0, max(0, step - begin) / decay)
    else:
        span = last - tr.warmup_steps
        frac = min(1.0, (step - tr.warmup_steps) / span) if span > 0 else 1.0
    if schedule == "cosine":
        frac = (1 - math.cos(math.pi * frac)) / 2
    return tr.lr + (tr.min_lr - tr.lr) * frac
