"""Pure-torch reference kernels: the numerical specification every backend is checked against.

Each is written with plain tensor math so autograd supplies the backward. Inputs are
computed in float32 internally where the math is reduction-heavy and cast back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from chipset.kernels.blockwise import attention_block, attention_block_backward
from chipset.kernels.fp8 import fp8_matmul

__all__ = [
    "rms_norm",
    "layer_norm",
    "rotary_embedding",
    "swiglu",
    "scaled_dot_product_attention",
    "cross_entropy",
    "fused_adamw",
    "linear",
    "grouped_mm",
    "grouped_mlp",
    "REFERENCE_KERNELS",
]


linear = F.linear
"""``linear(x, weight, bias=None)``: ``x @ weight.T + bias`` (``x [..., in]``, ``weight [out, in]``,
``bias [out]`` or None) -> ``[..., out]`` in ``x``'s dtype: the product of every linear layer
(parallel/linear.py routes them through it). torch's own op, unwrapped: a layer that resolves the
kernel once calls exactly what ``nn.Linear`` calls, with no Python frame in between."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y * weight if weight is not None else y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """Layer normalisation over the last dim."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = ((xf - mean) * torch.rsqrt(var + eps)).to(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim: ``x*cos + rotate_half(x)*sin``.

    ``x``: (..., seq, head_dim); ``cos``/``sin``: broadcastable to ``x``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return gate * torch.sigmoid(gate) * up


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over (batch, heads, seq, head_dim).

    ``mask``: bool (True = attend) or additive float, broadcastable to (b, h, sq, sk).
    ``causal``: query i attends keys j <= i + (sk - sq) (bottom-right aligned).
    Keys/values with fewer heads than queries (grouped-query attention) are repeated.
    """
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    sq, sk = q.shape[-2], k.shape[-2]
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1)
    # Rows with nothing to attend to produce zeros, not NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Softmax cross-entropy over the last dim of ``logits`` (N, V) with int targets (N,)."""
    lf = logits.float()
    logz = torch.logsumexp(lf, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = lf.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, logz - picked, torch.zeros_like(logz))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', found {reduction!r}")


@torch.no_grad()
def fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    """One AdamW step over lists of tensors, in place (decoupled weight decay). ``step`` is 1-based."""
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g = g.to(m.dtype)
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / bc2).sqrt_().add_(eps)
        p.addcdiv_((m / bc1).to(p.dtype), denom.to(p.dtype), value=-lr)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matrix multiply (the experts of a MoE layer): rows of ``x`` ``[T, in]`` come in
    groups, group ``g`` being rows ``offs[g-1]:offs[g]`` (``offs``: int32 cumulative group ends,
    ``offs[-1] == T``; a group may be empty), and group ``g`` is multiplied by ``w[g]``
    ``[in, out]``. Returns ``[T, out]``. One matmul per group, in the input dtype."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    outs = [x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends, strict=True))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


def grouped_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                offs: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLPs of a MoE layer's experts on grouped rows (``x``, ``offs`` as in
    :func:`grouped_mm`): group ``g``'s rows ``r`` give ``swiglu(r @ w_gate[g], r @ w_up[g]) @
    w_down[g]``, with ``w_gate``, ``w_up`` ``[groups, in, ffn]`` and ``w_down`` ``[groups, ffn, out]``
    (possibly transposed views). Returns ``[T, out]``: :func:`grouped_mm`, :func:`swiglu` and
    :func:`grouped_mm` again, in the input dtype. A backend implements it to run each group's
    whole MLP at once (its rows stay in cache); where it does not, the layer calls its
    ``grouped_mm`` and ``swiglu`` kernels in this order (layers/moe.py)."""
    return grouped_mm(swiglu(grouped_mm(x, w_gate, offs), grouped_mm(x, w_up, offs)), w_down, offs)


REFERENCE_KERNELS = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rotary_embedding": rotary_embedding,
    "swiglu": swiglu,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "cross_entropy": cross_entropy,
    "fused_adamw": fused_adamw,
    "linear": linear,
    "grouped_mm": grouped_mm,
    "grouped_mlp": grouped_mlp,
    "fp8_matmul": fp8_matmul,
    "attention_block": attention_block,
    "attention_block_backward": attention_block_backward,
}
