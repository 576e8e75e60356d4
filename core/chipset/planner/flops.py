"""FLOPs of one training step: matrix multiplications only, one multiply-add = 2 FLOPs.

Per token and block, forward (h hidden, f MLP width, k = kv_heads*head_dim, s sequence):
attention projections 2h(2h + 2k), attention core 4sh (QK^T and AV over the full s x s
matrix, causal masking not discounted, as Narayanan et al. count it), MLP 6hf (SwiGLU) or
4hf (GeLU), times top_k for MoE blocks plus a 2hE router; logits 2hV once per token.
Backward is twice the forward. Recompute adds a forward of what it recomputes: the
attention core ("selective", Korthikanti et al. 2022 Sec. 5) or the whole block ("full";
the logit layer is never recomputed).

For GPT-3 (MHA, f = 4h) this is exactly Narayanan et al. 2021 eq. (3):
full recompute 96Bslh^2 (1 + s/6h + V/16lh); without 72Bslh^2 (1 + s/6h + V/12lh).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from chipset.planner.model import ModelSpec

__all__ = ["ForwardFlops", "forward_flops_per_token", "step_flops", "model_flops_per_token",
           "narayanan_flops", "matmul_params"]


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token, split by where they are spent."""

    attention_proj: int
    """Q, K, V and output projections over all blocks."""
    attention_core: int
    """QK^T and attention-weighted V over all blocks (the s^2 part)."""
    mlp: int
    """MLPs (active experts only) and routers over all blocks."""
    logits: int
    """The output projection to the vocabulary."""

    @property
    def blocks(self) -> int:
        """Everything a full recompute repeats."""
        return self.attention_proj + self.attention_core + self.mlp

    @property
    def total(self) -> int:
        return self.blocks + self.logits


def forward_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> ForwardFlops:
    """Forward FLOPs per token for ``m`` at sequence length ``seq_len`` (default m.seq_len)."""
    return _forward_flops(m, seq_len or m.seq_len)


@functools.lru_cache(maxsize=256)
def _forward_flops(m: ModelSpec, s: int) -> ForwardFlops:
    h, f = m.hidden, m.ffn
    per_mlp = (6 if m.mlp == "swiglu" else 4) * h * f
    mlp = m.dense_layers * per_mlp
    if m.is_moe:
        shared = ((6 if m.mlp == "swiglu" else 4) * h * m.shared_ffn + 2 * h) if m.shared_ffn else 0
        mlp += m.moe_layers * (m.top_k * per_mlp + 2 * h * m.num_experts + shared)
    return ForwardFlops(
        attention_proj=m.layers * 2 * h * (2 * h + 2 * m.kv_dim),
        attention_core=m.layers * 4 * s * h,
        mlp=mlp,
        logits=2 * h * m.vocab,
    )


def step_flops(m: ModelSpec, global_batch: int, recompute: str = "none", seq_len: int | None = None) -> int:
    """FLOPs the hardware executes in one step of ``global_batch`` sequences (recompute included)."""
    s = seq_len or m.seq_len
    fw = forward_flops_per_token(m, s)
    per_token = 3 * fw.total
    if recompute == "selective":
        per_token += fw.attention_core
    elif recompute == "full":
        per_token += fw.blocks
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full (found {recompute!r})")
    return per_token * global_batch * s


def matmul_params(m: ModelSpec) -> int:
    """Weights one token multiplies with: active blocks' matrices and the logit matrix.

    The input embedding is a lookup (no FLOPs); biases and norms are not matmuls. This is the
    N of PaLM's 6N + 12LHQT, chosen so that the formula equals this module's count exactly.
    """
    fw = forward_flops_per_token(m)
    return (fw.attention_proj + fw.mlp + fw.logits) // 2


def model_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> int:
    """PaLM's model FLOPs per token, 6N + 12·L·H·Q·T (Chowdhery et al. 2022, App. B): no recompute."""
    s = seq_len or m.seq_len
    return 6 * matmul_params(m) + 12 * m.layers * m.heads * m.head_dim * s


def narayanan_flops(B: int, s: int, L: int, h: int, V: int, recompute: bool = True) -> float:
    """Narayanan et al. 2021 eq. (3) (full recompute) or its no-recompute form, verbatim (L = their l)."""
    if recompute:
        return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
