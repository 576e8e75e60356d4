"""Per-token log-probabilities under every layout, and the per-token loss hook.

:func:`token_logprobs` runs a rank's shard of the model (ZeRO-3 gathers its units in forward;
under tp the vocabulary-split logits are gathered across the tp group, with their gradient)
and returns ``log p(tokens[:, t+1] | tokens[:, :t+1])`` per position, plus each position's
entropy. :func:`forward_logprobs` is the forward-only pass (evaluation, distillation, the
old and reference policies of GRPO). :func:`per_token_loss` swaps the engine's loss for a
function of those log-probabilities for the steps inside it: GRPO uses it, and so can a
user's DPO- or KTO-style objective (``chipset.api.per_token_loss``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from chipset.errors import ConfigError
from chipset.parallel.tensor import gather_along, vocab_parallel_loss
from chipset.runtime.precision import compute_input

__all__ = ["token_logprobs", "forward_logprobs", "per_token_loss"]


class _GatherVocabKeepSlice(torch.autograd.Function):
    """All-gather the vocabulary slices of the logits; backward keeps this rank's slice of a
    gradient every tp rank holds whole (the log-softmax and the loss after it run replicated,
    so summing the ranks' gradients, as a plain all-gather's backward would, counts it tp times)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.n = tp, x.shape[-1]
        return gather_along(x, x.dim() - 1, tp.collective, tp.group)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(-1, ctx.tp.rank * ctx.n, ctx.n).contiguous(), None


def _full_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole vocabulary: a tensor-parallel head's slices gathered (with gradient)
    and a padded vocabulary cut to ``model.cfg.vocab_size`` or the loss's ``vocab_size``."""
    split = vocab_parallel_loss(model)
    tp = getattr(split, "tp", None)
    if tp is not None:
        logits = _GatherVocabKeepSlice.apply(logits, tp)
        logits = logits[..., :split.vocab_size]
    return logits


def token_logprobs(model, tokens: torch.Tensor, with_entropy: bool = False):
    """``[batch, seq-1]`` log-probabilities (float32) of ``tokens[:, 1:]`` under ``model`` (this
    rank's shard, any layout but cp/pp), and with ``with_entropy`` the entropy of each
    position's distribution (no gradient)."""
    if getattr(model, "seq_layout", None) is not None:
        raise ConfigError("per-token log-probabilities need whole sequences on each rank; use parallel.cp = 1")
    logits = _full_logits(model, model(tokens)).float()[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)
    return picked, ent


@torch.no_grad()
def forward_logprobs(engine, tokens: torch.Tensor, with_entropy: bool = False):
    """:func:`token_logprobs` of ``tokens`` (on the engine's device) under ``engine`` without a
    backward: every rank of the model's tp group calls it with the same tokens."""
    out = token_logprobs(engine.model, compute_input(tokens, engine.dtype), with_entropy)
    release = getattr(engine, "release_units", None)
    if release is not None:
        release()
    return out


@contextlib.contextmanager
def per_token_loss(engine, fn: Callable[[torch.Tensor, object], torch.Tensor]) -> Iterator[None]:
    """Inside, a training step's micro-batch ``(tokens, extra)`` is scored as
    ``fn(logprobs, extra)``: ``logprobs`` is :func:`token_logprobs` of ``tokens`` (``[b, s-1]``,
    with gradient) and ``extra`` whatever the step was given as the micro-batch's second item
    (masks, advantages, reference log-probs...). ``fn`` returns the micro-batch's scalar loss;
    the engine averages it over micro-batches and dp ranks, reduces gradients and updates as for
    cross-entropy. Needs an engine without pipeline stages (parallel.pp = 1)."""
    bound = getattr(engine, "bound", None)
    if not callable(getattr(bound, "with_loss", None)) or engine.dims.pp_enabled:
        raise ConfigError("a per-token loss needs the data-parallel engine (parallel.pp = 1) of a model "
                          "bound to its family (chipset.api.parallelize)")
    model = engine.model
    engine.bound = bound.with_loss(lambda tokens, extra: fn(token_logprobs(model, tokens), extra))
    try:
        yield
    finally:
        engine.bound = bound
