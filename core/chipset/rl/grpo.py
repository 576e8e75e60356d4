"""Advantages and the clipped policy loss of GRPO (formulas: docs/rl.md, "The loss").

Notation: ``r_i`` the reward of completion ``i`` of a group of ``G`` completions of one prompt,
``pi`` the policy being trained, ``pi_old`` the policy that sampled, ``pi_ref`` the frozen
reference, ``rho_t = pi(o_t) / pi_old(o_t)`` per completion token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["STD_EPS", "group_advantages", "GRPOBatch", "grpo_token_loss"]

STD_EPS = 1e-4
"""Added to a standard deviation before dividing by it (a group whose rewards are all equal)."""


def group_advantages(rewards: torch.Tensor, kind: str, scale: bool = True) -> torch.Tensor:
    """Per-completion advantages of ``rewards`` shaped ``[groups, G]``.

    * ``grpo``: ``A_i = (r_i - mean(r)) / (std(r) + STD_EPS)`` (population std; without ``scale``,
      ``r_i - mean(r)``);
    * ``rloo``: ``A_i = r_i - mean_{j != i}(r_j) = G / (G - 1) * (r_i - mean(r))``;
    * ``reinforce++``: ``A_i = r_i - mean(r)``, normalised afterwards over the whole batch by
      :func:`batch_normalise` (the loop does that across dp ranks).
    """
    r = rewards.double()
    centred = r - r.mean(dim=1, keepdim=True)
    g = r.shape[1]
    if kind == "grpo":
        out = centred / (r.std(dim=1, unbiased=False, keepdim=True) + STD_EPS) if scale else centred
    elif kind == "rloo":
        out = centred * (g / (g - 1)) if g > 1 else torch.zeros_like(r)
    elif kind == "reinforce++":
        out = centred
    else:
        raise ValueError(f"unknown advantage {kind!r}")
    return out.float()


@dataclass
class GRPOBatch:
    """What one micro-batch carries besides its tokens (all ``[b, s-1]``, aligned with the
    log-probabilities of ``tokens[:, 1:]``): the completion mask, each token's advantage, the
    sampling policy's and the reference's log-probs, and the loss's normaliser share."""

    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    weights: torch.Tensor
    """Per-token weight of the global mean: 1/N_tokens (token averaging) or 1/(n_i * N_seq)
    (sequence averaging), times micro_batches x dp (the engine divides by both)."""


def grpo_token_loss(logprobs: torch.Tensor, b: GRPOBatch, *, clip_eps: float, kl_coef: float,
                    stats: dict | None = None) -> torch.Tensor:
    """The micro-batch's share of the GRPO loss:
    ``sum_t w_t * [ -min(rho_t A_t, clip(rho_t, 1-eps, 1+eps) A_t) + beta * KL_t ]`` over
    completion tokens, with the k3 estimate ``KL_t = exp(ref_t - lp_t) - (ref_t - lp_t) - 1``.
    ``stats`` (a dict) accumulates weighted sums of the KL and of the clipped fraction."""
    m = b.mask
    ratio = torch.exp(logprobs - b.old_logprobs)
    adv = b.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_tok = -torch.minimum(unclipped, clipped)
    kl = None
    if b.ref_logprobs is not None and kl_coef > 0:
        d = b.ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1
        per_tok = per_tok + kl_coef * kl
    loss = (per_tok * b.weights * m).sum()
    if stats is not None:
        with torch.no_grad():
            w = b.weights * m
            stats["clip_frac"] = stats.get("clip_frac", 0.0) + float(((clipped < unclipped).float() * w).sum())
            if kl is not None:
                stats["kl"] = stats.get("kl", 0.0) + float((kl * w).sum())
    return loss
