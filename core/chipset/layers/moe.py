"""Mixture-of-experts feed-forward layer: top-k router, expert capacity, load-balancing loss.

No torch.distributed here. Where the experts live is the dispatcher's business: by
default every expert is local; :func:`chipset.parallel.experts.apply_ep` shards the
stacked expert weights over the ep ranks and installs a dispatcher that moves tokens
with all-to-all. Which tokens of a sequence this rank holds is ``MoE.seq_layout``'s
(None: whole sequences; under context parallelism the router's logits are gathered over
the sequence, routed whole and this rank's share kept, ``parallel/moe.py``). The
routing below is the same in every case, so a sharded run drops the same tokens and
computes the same loss as one process.

Routing, per token (``router`` = ``softmax`` | ``sigmoid``):

* scores: ``softmax(x W_r^T)`` over the experts, or ``sigmoid(x W_r^T)`` per expert;
* the ``top_k`` highest scores choose the experts (``torch.topk``);
* gates: the chosen scores, renormalised to sum to 1 when ``top_k > 1`` (GShard, Mixtral;
  DeepSeek-V3 for sigmoid) unless ``norm_topk_prob`` is false (Qwen2-MoE keeps the raw
  softmax scores); with ``top_k = 1`` the raw score, as in Switch, so the
  router still receives gradient through the gate.

Shared expert (``shared_expert_intermediate_size > 0``, Qwen2-MoE): one more SwiGLU MLP
that every token passes through, scaled per token by ``sigmoid(x w_g)`` (a learned
scalar gate) and added to the routed experts' output. It is an ordinary dense weight:
replicated over ep and tp like the router, never dropped by capacity.

Capacity (token dropping). The routing group is one *sequence*: every expert accepts at
most ``C = ceil(capacity_factor * seq_len * top_k / num_experts)`` assignments from each
sequence (``capacity_factor = 0``: no limit). Assignments are admitted in a fixed order:
every token's first choice before any token's second choice (GShard's priority), and
within one choice level by position in the sequence; an assignment beyond the
expert's C-th is dropped (contributes nothing; the token keeps its residual, and its other
gates are not renormalised). Because the group is a sequence, which tokens are dropped
does not depend on how the batch is split over dp, ep or micro-batches.

Load-balancing loss (Switch Transformers, Fedus et al. 2021, eq. 4; with top-k counting
as in DeepSeek-V3's sequence-wise balance loss, Liu et al. 2024, eqs. 17-20), per sequence
of T tokens::

    aux = E * sum_i f_i * P_i,   f_i = (assignments to expert i) / (T * top_k),
                                 P_i = mean over tokens of p_i(token)

where p is the softmax probability (softmax router) or the sigmoid scores normalised
to sum to 1 per token (sigmoid router), and f counts the top-k choices before capacity
dropping. A perfectly balanced router gives 1. The layer's aux loss is the mean over the
batch's sequences; the model adds ``router_aux_loss_coef * sum over MoE layers`` to the loss.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from chipset.kernels import KernelRegistry

__all__ = ["MoE", "Experts", "SharedExpert", "Routing", "route", "is_moe_layer", "LocalDispatcher"]


def is_moe_layer(cfg: Any, index: int) -> bool:
    """Block ``index`` (0-based) is MoE: every ``moe_every``-th block, as the planner counts them."""
    return cfg.num_experts > 1 and (index + 1) % cfg.moe_every == 0


class Routing:
    """The router's decisions for a batch ``[b, s]`` of tokens (tensors ``[b, s, top_k]``)."""

    def __init__(self, experts: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor, aux_loss: torch.Tensor,
                 capacity: int | None):
        self.experts = experts
        """Chosen expert ids (int64)."""
        self.gates = gates
        """Gate of each choice (float32, differentiable)."""
        self.keep = keep
        """False where the choice was dropped by the expert's capacity."""
        self.aux_loss = aux_loss
        """Load-balancing loss: mean over sequences (scalar, float32, differentiable)."""
        self.capacity = capacity
        """Assignments each expert accepts per sequence (None: unlimited)."""


def capacity(capacity_factor: float, seq_len: int, top_k: int, num_experts: int) -> int | None:
    """Assignments an expert accepts per sequence; None when ``capacity_factor`` is 0 (no dropping)."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * seq_len * top_k / num_experts)


def route(logits: torch.Tensor, *, top_k: int, router: str = "softmax", capacity_factor: float = 0.0,
          normalize: bool = True) -> Routing:
    """Route ``logits [b, s, E]`` (see the module docstring for every rule)."""
    b, s, n_exp = logits.shape
    logits = logits.float()
    if router == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    elif router == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"router {router!r}: expected softmax or sigmoid")
    top, experts = scores.topk(top_k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True) if top_k > 1 and normalize else top
    # One-hot of the choices in admission order: choice level major, position minor.
    order = experts.transpose(1, 2).reshape(b, top_k * s)
    onehot = F.one_hot(order, n_exp)  # [b, k*s, E]
    cap = capacity(capacity_factor, s, top_k, n_exp)
    if cap is None:
        keep = torch.ones_like(experts, dtype=torch.bool)
    else:
        slot = ((onehot.cumsum(dim=1) - 1) * onehot).sum(dim=-1)  # place in its expert's queue
        keep = (slot < cap).view(b, top_k, s).transpose(1, 2)
    f = onehot.sum(dim=1).float() / (s * top_k)  # [b, E], before dropping
    p = probs.mean(dim=1)  # [b, E]
    aux = (n_exp * (f * p).sum(dim=-1)).mean()
    return Routing(experts, gates, keep, aux, cap)


class Experts(nn.Module):
    """``num_local`` SwiGLU experts, weights stacked on dim 0 (``[E_local, out, in]``, as nn.Linear).

    ``first`` is the global id of expert 0 here (0 unless expert parallelism sharded them).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, kernels: KernelRegistry):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.first = 0
        self._k = kernels

    @property
    def num_local(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens grouped by local expert (``counts[e]`` rows for expert e, in order).

        The backend's ``grouped_mlp`` kernel where it has one for these arguments (``cpu``:
        each expert's whole MLP on its rows while they are in cache); else three grouped
        GEMMs (the ``grouped_mm`` kernel: one call for all experts where the backend has one;
        the reference loops over the experts) around the ``swiglu`` kernel, which is
        ``grouped_mlp``'s reference through this backend's own kernels."""
        if not counts:
            return x[:0]
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        w = (self.gate_proj.transpose(1, 2), self.up_proj.transpose(1, 2), self.down_proj.transpose(1, 2))
        fused = self._k.select("grouped_mlp", x, *w, offs)
        if fused is not self._k.reference("grouped_mlp"):
            return fused(x, *w, offs)
        mm = self._k.grouped_mm
        return mm(self._k.swiglu(mm(x, w[0], offs), mm(x, w[1], offs)), w[2], offs)


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token passes through (the names are Qwen2-MoE's ``shared_expert``)."""

    def __init__(self, hidden: int, intermediate: int, kernels: KernelRegistry):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._k = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._k.swiglu(self.gate_proj(x), self.up_proj(x)))


class Dispatcher(Protocol):
    def __call__(self, tokens: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
        """``tokens`` sorted by global expert id, ``counts[e]`` for each of the E experts -> outputs, same order."""


class LocalDispatcher:
    """Every expert is on this rank: run them directly."""

    def __call__(self, tokens: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
        return experts(tokens, counts)


class _Combine(torch.autograd.Function):
    """``y = zeros(n, h); y[token[i]] += gate[i] * out[i]``: the experts' outputs back to their
    tokens, weighted by their gates, as one autograd node. Its backward gathers the output
    gradient once and scales it in place; the products and sums are those autograd forms for
    ``index_add(out * gate)``, so the results are the same bits with one ``[assignments, h]``
    buffer fewer."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, gate: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
        g = gate.unsqueeze(1).to(out.dtype)
        ctx.save_for_backward(out, g, token)
        ctx.gate_dtype = gate.dtype
        return out.new_zeros(n, out.shape[1]).index_add_(0, token, out * g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, g, token = ctx.saved_tensors
        d = grad.index_select(0, token)
        dgate = (d * out).sum(1).to(ctx.gate_dtype) if ctx.needs_input_grad[1] else None
        return d.mul_(g), dgate, None, None


class MoE(nn.Module):
    """Drop-in for the dense MLP: ``forward(x [b, s, h]) -> [b, s, h]``; ``aux_loss`` after each forward."""

    def __init__(self, cfg: Any, kernels: KernelRegistry):
        # cfg: a model config with the MoE keys (chipset.models.config.ModelConfig: hidden_size,
        # moe_intermediate_size, num_experts, num_experts_per_tok, router, capacity_factor, ...).
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.router_kind = cfg.router
        self.capacity_factor = cfg.capacity_factor
        self.normalize = cfg.norm_topk_prob
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        width = cfg.moe_intermediate_size or cfg.intermediate_size
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, width, kernels)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size, kernels)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.seq_layout = None
        """None: this rank holds whole sequences. Else ``full(t)`` (every rank's part of ``t``
        [b, s_local, ...] gathered, differentiably, into sequence order) and ``local(t)`` (this
        rank's part of a whole-sequence ``t``): routing groups are whole sequences."""
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None
        """The latest forward's routing (inspection: which assignments were dropped)."""
        self.layer: int | None = None
        """The index of this layer's block in the model (set by the model; names the layer in metrics)."""
        self.load: torch.Tensor | None = None
        """Router choices per expert since :meth:`reset_load` (``[E]`` int64, before capacity dropping),
        then the dropped count: the per-step routing summary of metrics.jsonl (``chipset diagnose``)."""

    def reset_load(self) -> None:
        self.load = None

    def _count(self, r: Routing) -> None:
        with torch.no_grad():
            n = torch.bincount(r.experts.reshape(-1), minlength=self.num_experts)
            counts = torch.cat([n, (~r.keep).sum().reshape(1)])
            self.load = counts if self.load is None else self.load + counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        logits = self.router(x)
        if self.seq_layout is not None:  # capacity and the aux loss count whole sequences
            logits = self.seq_layout.full(logits)
        r = route(logits, top_k=self.top_k, router=self.router_kind, capacity_factor=self.capacity_factor,
                  normalize=self.normalize)
        if self.seq_layout is not None:
            sl = self.seq_layout
            r = Routing(sl.local(r.experts), sl.local(r.gates), sl.local(r.keep), r.aux_loss, r.capacity)
        self.aux_loss, self.last_routing = r.aux_loss, r
        self._count(r)
        flat = x.reshape(b * s, h)
        # Assignment i is token i // top_k's choice i % top_k. One stable sort groups them by
        # expert (within an expert, batch order); dropped ones get key E and sort last, cut off.
        expert = r.experts.reshape(-1)
        if r.capacity is not None:
            expert = expert.masked_fill(~r.keep.reshape(-1), self.num_experts)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts + 1).tolist()[:self.num_experts]
        order = order[:sum(counts)]
        token, gate = order // self.top_k, r.gates.reshape(-1)[order]
        out = self.dispatcher(flat.index_select(0, token), counts, self.experts)
        y = _Combine.apply(out, gate, token, b * s).view(b, s, h)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
