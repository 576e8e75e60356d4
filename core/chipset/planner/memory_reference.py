"""Activation and work-buffer bytes of chipset's engine running its reference kernels.

The reference kernels (``chipset.kernels.reference``, what cpu_sim runs) are plain torch
code, so autograd saves what each op needs: RMSNorm keeps a float32 copy of its input, its
reciprocal root and the normalised output; attention upcasts q, k and v to float32 (k and
v repeated to every query head, and gathered over cp), materialises the scores and keeps
both the softmax and its NaN-cleaned copy; SwiGLU keeps gate, up, sigmoid(gate), their
product and the down projection's input; cross-entropy keeps float32 logits. Under
sequence parallelism the projections reading one norm (q, k, v; gate, up) share one
contiguous copy of the gathered sequence;
ring attention (cp) keeps only its inputs, its output and the float32 log-sum-exp (the
blockwise kernels, kernels/blockwise.py); Ulysses keeps q and k, v repeated to the local
query heads, all of the whole sequence for heads/cp heads, its output and the log-sum-exp;
hybrid (Ulysses over ``u = cp_ulysses``, ring across) keeps what the ring keeps on its
head-split inputs: q, k and v (kv heads repeated up to a multiple of u), output, log-sum-exp.
Activation offload (``offload_activations``) keeps no block's saved tensors on the device
but the one whose backward runs, and of that one (with blockwise cp attention) only the
running node's (:func:`offloaded_block_backward_bytes`); a chunked loss (``loss_chunk``) keeps the head's input
and one chunk's logits at a time.
Each count below was checked tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks``
on the engine's model (docs/planner.md, "Validation: peak memory").

All functions return bytes per local token of one micro-batch (``T = b*s/cp`` tokens) unless
they say otherwise. ``E`` is the compute dtype's size, ``F = 4`` (float32).
"""

from __future__ import annotations

import math

from chipset.kernels.blockwise import TILE_SCORES
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import ModelSpec

__all__ = ["block_bytes_per_token", "mask_bytes", "head_bytes_per_token", "embed_bytes_per_token", "loss_tokens",
           "loss_backward_bytes_per_token", "block_backward_bytes", "attention_tile_bytes",
           "offloaded_attention_backward_bytes", "offloaded_block_backward_bytes", "F"]

F = 4
BLOCKWISE = ("ring", "ulysses", "hybrid")
"""cp attentions that run the blockwise kernels (no mask, no score matrix)."""


def hybrid_kv_width(m: ModelSpec, lay: Layout) -> float:
    """Width of k (or v) per local token after the hybrid's all-to-all: kv heads per tp rank
    repeated up to a multiple of the Ulysses degree (parallel/hybrid.py)."""
    kv_heads = max(1, round(m.kv_dim / m.head_dim / lay.tp))
    return math.lcm(kv_heads, lay.cp_ulysses) * m.head_dim


def _norm(m: ModelSpec, lay: Layout, e: int) -> float:
    """One RMSNorm: float32 input copy and normalised output, their reciprocal root; sequence-split under sp."""
    return ((F + e) * m.hidden + F) / (lay.tp if lay.sp else 1)


def _core(m: ModelSpec, lay: Layout, seq_len: int, e: int) -> float:
    """What the attention core saves per local token."""
    h, t, a = m.hidden, lay.tp, m.heads
    if lay.recompute == "selective":  # the checkpointed core keeps q, k, v as they came out of the projections
        core = e * (h + 2 * m.kv_dim) / t
    elif lay.cp > 1 and lay.cp_attention == "ring":  # q, the local k, v, the output and float32 log-sum-exp
        core = (e * (2 * h + 2 * m.kv_dim) + F * a) / t
    elif lay.cp > 1 and lay.cp_attention == "ulysses":  # q, k and v on the local heads' query width, output, lse
        core = (4 * e * h + F * a) / t
    elif lay.cp > 1 and lay.cp_attention == "hybrid":  # q, k, v after the all-to-all, the output and lse
        core = (2 * e * h + F * a) / t + 2 * e * hybrid_kv_width(m, lay)
    else:  # float32 q, k and v (k, v repeated to every head and gathered over cp), softmax and its clean copy
        core = F * h / t * (1 + 2 * lay.cp) + 2 * F * (a / t) * seq_len
    return core


def block_bytes_per_token(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec) -> float:
    """Saved bytes of one block per local token (without the attention mask, see :func:`mask_bytes`)."""
    e, h, t = train.param_bytes, m.hidden, lay.tp
    if lay.recompute == "full":  # the checkpoint keeps the block input only
        return e * h / (t if lay.sp else 1)
    # The norm's output, saved by q, k and v; under sp gathered once into one contiguous tensor
    # they share (parallel/tensor.py, enter_region).
    attn_in = e * h
    core = _core(m, lay, seq_len, e)
    attn_out = e * h / t
    dense_mlp = e * h + 5 * e * m.ffn / t
    mlp = dense_mlp
    if m.is_moe:
        k = m.top_k
        # router input, router softmax/top-k (float32), token and expert ids; per assignment the
        # dispatched and returned token copies (4h) and the expert's SwiGLU (5f)
        moe_mlp = e * h + F * (m.num_experts + 2 * k + 1) + 25 * k + k * (4 * e * h + 5 * e * m.ffn)
        if m.shared_ffn:  # the shared expert's SwiGLU (5f) and its output, kept for the gate's product
            moe_mlp += 5 * e * m.shared_ffn + e * h
        frac = m.moe_layers / m.layers
        mlp = (1 - frac) * dense_mlp + frac * moe_mlp
    return 2 * _norm(m, lay, e) + attn_in + core + attn_out + mlp


def mask_bytes(m: ModelSpec, lay: Layout, seq_len: int) -> float:
    """The boolean causal mask one block builds per micro-batch (local queries x all keys)."""
    if lay.recompute != "none" or (lay.cp > 1 and lay.cp_attention in BLOCKWISE):
        return 0.0
    return seq_len / lay.cp * seq_len


def embed_bytes_per_token(lay: Layout) -> float:
    """Token ids the embedding keeps for its backward (int64), plus the vocabulary-shard mask under tp."""
    return 8 + (1 if lay.tp > 1 else 0)


def head_bytes_per_token(m: ModelSpec, lay: Layout, train: TrainSpec) -> float:
    """Final norm, the logit projection's input (gathered under sp), float32 logits (under tp their
    exponentials), the log-sum-exp, target ids and masks."""
    e = train.param_bytes
    return _norm(m, lay, e) + e * m.hidden + F * m.vocab / lay.tp + 2 * F + 10


def frontier_grad_bytes_per_token(m: ModelSpec, lay: Layout, train: TrainSpec, blocks: int, head: bool) -> float:
    """Zero bubble: the gradients a micro-batch's input half keeps for its weight half (the output
    gradient of every node with a weight: per block the two norms, q, k, v, o and the MLP's three
    projections; on the last stage the final norm and the logits)."""
    e, t = train.param_bytes, lay.tp
    block = e * (2 * m.hidden + (2 * m.hidden + 2 * m.kv_dim + 2 * m.ffn + m.hidden) / t)
    return blocks * block + (e * (m.hidden + m.vocab / t) if head else 0.0)


def loss_tokens(lay: Layout, tokens: float, batch: int) -> float:
    """Tokens whose logits exist at once: a chunk of ``loss_chunk`` (whole columns of the
    ``batch`` sequences, as the model cuts them), or all ``tokens``."""
    if not lay.loss_chunk:
        return tokens
    return min(tokens, max(1, lay.loss_chunk // batch) * batch)


def loss_backward_bytes_per_token(m: ModelSpec, lay: Layout) -> float:
    """Float32 vocabulary-sized buffers alive in the cross-entropy's backward on top of the saved logits:
    four (softmax gradient, gather gradient, and the expression's temporaries), two vocabulary-parallel."""
    return (4 if lay.tp == 1 else 2) * F * m.vocab / lay.tp


def block_backward_bytes(m: ModelSpec, lay: Layout, tokens: float, train: TrainSpec) -> float:
    """A block's backward in progress (total bytes): the incoming activation gradient, the gradient of the
    MLP's intermediate and one weight gradient before it is accumulated."""
    e, h, t = train.param_bytes, m.hidden, lay.tp
    if m.is_moe and not m.experts_split_over_tp:  # whole experts on every tp rank
        t = 1
    f = m.ffn * (m.top_k if m.is_moe else 1)
    return e * tokens * (h + f / t) + e * h * m.ffn / t + attention_tile_bytes(m, lay, tokens)


def offloaded_block_backward_bytes(m: ModelSpec, lay: Layout, tokens: float, train: TrainSpec) -> float | None:
    """With activation offload: the most one block's backward holds at once (total bytes), node by node
    (autograd copies a node's saved tensors back when that node runs, and drops them after): the larger
    of the attention's backward (:func:`offloaded_attention_backward_bytes`) and the SwiGLU product's
    (its incoming gradient, the two saved factors and their two gradients, f wide each, and the residual
    stream's gradient). None where this is not modelled (dense attention, MoE, recompute): there every
    saved tensor of the block counts as back on the device."""
    if (not lay.offload_activations or lay.cp == 1 or lay.cp_attention not in BLOCKWISE or m.is_moe
            or lay.recompute != "none"):
        return None
    e, h, t = train.param_bytes, m.hidden, lay.tp
    mlp = tokens * (5 * e * m.ffn / t + e * h / (t if lay.sp else 1)) + e * h * m.ffn / t
    return max(offloaded_attention_backward_bytes(m, lay, tokens, train), mlp)


def offloaded_attention_backward_bytes(m: ModelSpec, lay: Layout, tokens: float, train: TrainSpec) -> float:
    """With activation offload and blockwise cp attention: what the attention's backward holds (total
    bytes). Autograd copies a node's saved tensors back only when that node runs, so the attention
    node has on the device its own saved tensors (:func:`_core`), the incoming gradients (the residual
    stream's and the attention output's; Ulysses and hybrid also that one after its all-to-all) and its
    working set: the ring's float32 query gradient and travelling (k, v, dk, dv) block, kv heads
    repeated to the query heads, the kernel's float32 dq, dk, dv, and the score tiles."""
    e, h, t = train.param_bytes, m.hidden, lay.tp
    q = h / t  # local query width
    kv = hybrid_kv_width(m, lay) if lay.cp_attention == "hybrid" else m.kv_dim / t
    grads = e * h / (t if lay.sp else 1) + e * q
    kernel = 3 * F * q
    if lay.cp_attention == "ulysses":  # one block kernel over q, k, v already repeated to the query heads
        work = e * q + kernel
    else:  # ring (alone, or across the hybrid's Ulysses groups: then after an all-to-all of the gradient)
        repeated = 2 * e * q if kv < q else 0.0
        work = F * q + 4 * F * kv + repeated + kernel + (e * q if lay.cp_attention == "hybrid" else 0.0)
    return tokens * (_core(m, lay, 0, e) + grads + work) + attention_tile_bytes(m, lay, tokens)


def attention_tile_bytes(m: ModelSpec, lay: Layout, tokens: float) -> float:
    """Ring and Ulysses attention through the reference block kernels (kernels/blockwise.py):
    the float32 scores and probabilities of one query tile, both alive while the tile's
    gradients are computed (at most ``TILE_SCORES`` elements each)."""
    if lay.cp == 1 or lay.cp_attention not in BLOCKWISE:
        return 0.0
    s_local = tokens / lay.micro_batch
    if lay.cp_attention == "ring":  # the own block: local queries x local keys
        heads, sq = m.heads / lay.tp, s_local
    elif lay.cp_attention == "hybrid":  # the ring's own block: the Ulysses group's tokens on heads / u
        heads, sq = m.heads / lay.tp / lay.cp_ulysses, s_local * lay.cp_ulysses
    else:  # the whole sequence on heads / cp heads
        heads, sq = m.heads / lay.tp / lay.cp, s_local * lay.cp
    return 2 * F * min(TILE_SCORES, lay.micro_batch * heads * sq * sq)
