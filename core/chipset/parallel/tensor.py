"""Tensor parallelism (Megatron-style) and sequence parallelism, through ``backend.collective``.

Layers (each a drop-in for the module it replaces; parameter names stay the same):

* :class:`ColumnParallelLinear` — the output features are split over tp ranks. Its input
  enters the tp region (:func:`enter_region`): identity forward / all-reduce backward (or,
  with sequence parallelism, all-gather of the sequence forward / reduce-scatter backward).
* :class:`TPRegionNorm` — the RMSNorm in front of column-parallel projections that read the
  same input (q, k, v; gate, up; the logit layer): its output enters the tp region once for
  all of them, so backward sums their input gradients first and needs one collective per
  region, as Megatron-LM's fused projections do (4 per block, not one per projection).
* :class:`RowParallelLinear` — the input features are split; the partial outputs are
  all-reduced (or reduce-scattered along the sequence with sequence parallelism).
* :class:`VocabParallelEmbedding` — rows of the (padded) vocabulary are split; ids outside
  a rank's range look up zeros, and the partial embeddings are summed.
* :func:`vocab_parallel_cross_entropy` — cross-entropy over logits whose vocabulary is
  split across ranks, without gathering them: a max all-reduce and one sum all-reduce.
  With sequence parallelism each rank normalises its own slice of the sequence, so the
  (replicated) weight's gradient is a partial sum: it is all-reduced over tp in backward.

A vocabulary tp does not divide is padded to the next multiple of tp; the padded rows of
the embedding are never looked up and the padded logits are masked to -inf, so results
equal the unpadded model's and the padded weights stay zero.

Every sharded parameter carries a :class:`TPShard` record (the split dimension, its logical
size along it before padding, this rank's slice index), read with :func:`tp_shard`;
:func:`gather_full_parameters` and the checkpoint layout use it to rebuild single-process
tensors by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chipset.errors import ConfigError
from chipset.interfaces import Collective, Group
from chipset.parallel.linear import Product, RoutedLinear
from chipset.parallel.plan import PLAN_STYLES, plan_matches

__all__ = [
    "TPContext",
    "TPShard",
    "tp_shard",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "TPRegionNorm",
    "enter_region",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_loss",
    "apply_plan",
    "gather_sequence_around",
    "gather_full_parameters",
    "is_tp_sharded",
    "logical_slice",
    "gather_along",
    "reduce_scatter_along",
]


class TPContext:
    """The tensor-parallel group of this rank and whether sequence parallelism is on."""

    def __init__(self, collective: Collective, group: Group, *, sequence_parallel: bool = False):
        self.collective = collective
        self.group = group
        self.size = group.size
        self.rank = group.ranks.index(collective.rank())
        self.sequence_parallel = sequence_parallel


# --- collectives along a dimension (autograd-free helpers) ---------------------------------


def gather_along(x: torch.Tensor, dim: int, collective: Collective, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * xt.shape[0], *xt.shape[1:]), dtype=x.dtype, device=x.device)
    collective.all_gather(out, xt, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, collective: Collective, group: Group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's 1/size slice along ``dim``."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((xt.shape[0] // group.size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    collective.reduce_scatter(out, xt, "sum", group=group)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, collective: Collective, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    collective.all_reduce(out, "sum", group=group)
    return out


# --- the conjugate pairs as autograd functions ----------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward (input of a column-parallel layer; replicated weights under SP)."""

    @staticmethod
    def forward(ctx, x, collective, group):
        ctx.collective, ctx.group = collective, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.collective, ctx.group), None, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, collective, group):
        return _all_reduce(x, collective, group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _GatherAlong(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, collective, group):
        ctx.dim, ctx.collective, ctx.group = dim, collective, group
        return gather_along(x, dim, collective, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_along(g, ctx.dim, ctx.collective, ctx.group), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, collective, group):
        ctx.dim, ctx.collective, ctx.group = dim, collective, group
        return reduce_scatter_along(x, dim, collective, group)

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, ctx.dim, ctx.collective, ctx.group), None, None, None


def copy_to_group(x, collective, group):
    return _CopyToGroup.apply(x, collective, group)


def reduce_from_group(x, collective, group):
    return _ReduceFromGroup.apply(x, collective, group)


def all_gather_along(x, dim, collective, group):
    """Differentiable all-gather along ``dim`` (backward: reduce-scatter of the gradient)."""
    return _GatherAlong.apply(x, dim, collective, group)


def reduce_scatter_along_grad(x, dim, collective, group):
    return _ReduceScatterAlong.apply(x, dim, collective, group)


_SEQ = 1  # activations are (batch, seq, hidden)


# --- layers --------------------------------------------------------------------------------------


def _shard(full: torch.Tensor, dim: int, tp: TPContext) -> tuple[torch.Tensor, int]:
    """This rank's slice of ``full`` along ``dim``, zero-padded to a multiple of tp first."""
    size = full.shape[dim]
    padded = math.ceil(size / tp.size) * tp.size
    if padded != size:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    per = padded // tp.size
    return full.narrow(dim, tp.rank * per, per).clone(), size


@dataclass(frozen=True)
class TPShard:
    """Where a tensor-parallel parameter's local tensor sits in its logical one."""

    dim: int
    """The split dimension."""
    size: int
    """The logical size along ``dim`` (vocabulary padding excluded)."""
    rank: int
    """This rank's slice index: it holds entries ``rank * local .. (rank+1) * local - 1``."""


def tp_shard(p: torch.Tensor) -> TPShard | None:
    """The placement record of a tp-sharded parameter; None for a replicated one."""
    return getattr(p, "_chipset_tp_shard", None)


def _sharded_param(full: torch.Tensor, dim: int, tp: TPContext) -> nn.Parameter:
    data, size = _shard(full.detach(), dim, tp)
    p = nn.Parameter(data)
    p._chipset_tp_shard = TPShard(dim, size, tp.rank)
    return p


def enter_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """``x`` into the tp region: identity forward, all-reduce of the gradient backward; with
    sequence parallelism all-gather of the sequence forward, reduce-scatter backward."""
    if tp.sequence_parallel:
        # Gathered along dim 1 the result is a strided view; made contiguous once here it is shared
        # by every projection reading it (each matmul would otherwise copy, and save, its own).
        return all_gather_along(x, _SEQ, tp.collective, tp.group).contiguous()
    return copy_to_group(x, tp.collective, tp.group)


class ColumnParallelLinear(RoutedLinear):
    """``y = x W^T (+ b)`` with W's output rows (and b) split over tp; the output stays split.

    ``enter_region=False``: the input has entered the tp region already (a
    :class:`TPRegionNorm` in front, shared with the other projections reading it). ``product``:
    the local ``x W_r^T (+ b_r)`` (parallel/linear.py; the engine routes it when it builds the model).
    A ``vocab_head`` of the plan also holds the loss of its split logits (``vocab_loss``).
    """

    def __init__(self, full_weight: torch.Tensor, tp: TPContext, *, enter_region: bool = True,
                 full_bias: torch.Tensor | None = None, product: Product = F.linear):
        super().__init__()
        self.product = product
        self.tp = tp
        self.enter_region = enter_region
        self.weight = _sharded_param(full_weight, 0, tp)
        self.bias = None if full_bias is None else _sharded_param(full_bias, 0, tp)
        self.vocab_loss: _VocabParallelLoss | None = None
        """A vocab head's cross-entropy over its split logits (:func:`vocab_parallel_loss`); None
        for any other column-parallel layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_region(x, self.tp)
        return self.product(x, self.weight, self.bias)


class RowParallelLinear(RoutedLinear):
    """``y = x W^T (+ b)`` with W's input columns split over tp; partial outputs are summed over
    tp, then the (replicated) bias is added once. ``product``: the local partial ``x_r W_r^T``
    (parallel/linear.py; the engine routes it when it builds the model)."""

    def __init__(self, full_weight: torch.Tensor, tp: TPContext, *, full_bias: torch.Tensor | None = None,
                 product: Product = F.linear):
        super().__init__()
        self.product = product
        self.tp = tp
        self.weight = _sharded_param(full_weight, 1, tp)
        self.bias = None if full_bias is None else nn.Parameter(full_bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tp
        y = self.product(x, self.weight)
        if t.sequence_parallel:
            y = reduce_scatter_along_grad(y, _SEQ, t.collective, t.group)
        else:
            y = reduce_from_group(y, t.collective, t.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split over tp."""

    def __init__(self, full_weight: torch.Tensor, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = _sharded_param(full_weight, 0, tp)
        self.per = self.weight.shape[0]
        self.lo = tp.rank * self.per

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.tp
        outside = (tokens < self.lo) | (tokens >= self.lo + self.per)
        local = (tokens - self.lo).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if t.sequence_parallel:
            return reduce_scatter_along_grad(x, _SEQ, t.collective, t.group)
        return reduce_from_group(x, t.collective, t.group)


class TPRegionNorm(nn.Module):
    """RMSNorm whose output enters the tp region once, for every column-parallel projection reading it.

    q, k and v (gate and up) share their input: entering the region here rather than in each
    projection lets autograd sum the projections' input gradients before the one all-reduce
    (reduce-scatter with sequence parallelism), and with sequence parallelism gathers the
    sequence once, so the projections also share one saved gathered input. With sequence
    parallelism the norm runs on this rank's slice of the sequence, so the (replicated)
    weight's gradient is a partial sum and is all-reduced over tp.
    """

    def __init__(self, norm: nn.Module, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = norm.weight  # same Parameter: the name and the init are kept
        self.eps = norm.eps
        self._k = norm._k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.tp.sequence_parallel:
            w = copy_to_group(w, self.tp.collective, self.tp.group)
        return enter_region(self._k.rms_norm(x, w, self.eps), self.tp)


class TPHeadNorm(nn.Module):
    """RMSNorm over each head of a head-split tensor (Qwen3's q/k norm): the replicated weight
    only sees this rank's heads, so its gradient is all-reduced over tp."""

    def __init__(self, norm: nn.Module, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = norm.weight
        self.eps = norm.eps
        self._k = norm._k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x, copy_to_group(self.weight, self.tp.collective, self.tp.group), self.eps)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, vocab_size, ignore_index, collective, group):
        lf = logits.float()
        n_local = lf.shape[-1]
        cols = torch.arange(lo, lo + n_local, device=lf.device)
        if lo + n_local > vocab_size:  # padded vocabulary columns never win and get no gradient
            lf = lf.masked_fill(cols >= vocab_size, float("-inf"))
        m = lf.max(dim=-1).values
        collective.all_reduce(m, "max", group=group)
        ex = torch.exp(lf - m.unsqueeze(-1))
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < lo + n_local)
        idx = torch.where(mine, target - lo, torch.zeros_like(target))
        picked = torch.where(mine, lf.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
        both = torch.stack([ex.sum(dim=-1), picked])
        collective.all_reduce(both, "sum", group=group)
        sumexp, picked = both[0], both[1]
        loss = torch.where(valid, torch.log(sumexp) + m - picked, torch.zeros_like(m))
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(ex, sumexp, idx, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss.sum() / count

    @staticmethod
    def backward(ctx, g):
        ex, sumexp, idx, mine, valid, count = ctx.saved_tensors
        grad = ex / sumexp.unsqueeze(-1)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], idx[mine]] -= 1.0
        grad = grad * (valid.unsqueeze(-1) * (g / count))
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, tp: TPContext, vocab_size: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (N, V_padded/tp: this rank's vocabulary columns) on ``target`` (N,).

    Equals the unsharded ``cross_entropy`` on the full logits; padded columns (ids >=
    ``vocab_size``) are masked.
    """
    lo = tp.rank * logits.shape[-1]
    return _VocabParallelCE.apply(logits, target, lo, vocab_size, ignore_index, tp.collective, tp.group)


class _VocabParallelLoss:
    """A vocab head's ``vocab_loss`` (a small callable object rather than a lambda, for pickling/reprs)."""

    def __init__(self, tp: TPContext, vocab_size: int):
        self.tp, self.vocab_size = tp, vocab_size

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, tp=self.tp, vocab_size=self.vocab_size)


# --- sequence parallelism around a replicated module -------------------------------------------


class _GatherSeqKeepSlice(torch.autograd.Function):
    """All-gather along the sequence forward; backward keeps this rank's slice of a gradient
    that every rank holds whole (the module's backward is replicated over tp)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.n = tp, x.shape[_SEQ]
        return gather_along(x, _SEQ, tp.collective, tp.group)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(_SEQ, ctx.tp.rank * ctx.n, ctx.n).contiguous(), None


class _SliceSeqGatherGrad(torch.autograd.Function):
    """This rank's slice of a sequence every rank holds whole; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, y, tp):
        ctx.tp = tp
        n = y.shape[_SEQ] // tp.size
        return y.narrow(_SEQ, tp.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, _SEQ, ctx.tp.collective, ctx.tp.group), None


def gather_sequence_around(module: nn.Module, tp: TPContext) -> None:
    """Run ``module`` (replicated over tp) on whole sequences under sequence parallelism: its
    input is all-gathered over tp and its output cut back to this rank's slice (one all-gather
    each way); inside it every tp rank computes the same, as without sequence parallelism."""
    module.register_forward_pre_hook(lambda _m, args: (_GatherSeqKeepSlice.apply(args[0], tp), *args[1:]))
    module.register_forward_hook(lambda _m, _args, y: _SliceSeqGatherGrad.apply(y, tp))


# --- applying a model family's tensor-parallel plan -------------------------------------------------

LINEAR_STYLES = ("colwise", "colwise_in_region", "rowwise", "vocab_head", "vocab_head_in_region")
VOCAB_STYLES = ("vocab_embedding", "vocab_head", "vocab_head_in_region")
NORM_STYLES = ("region_norm", "head_norm", "sequence_norm")


def _split(name: str, mod: nn.Module, style: str, tp: TPContext) -> nn.Module | None:
    """The tensor-parallel replacement of ``mod`` for ``style`` (None: leave it)."""
    if style in LINEAR_STYLES and type(mod) is not nn.Linear:
        raise ConfigError(f"tp_plan: {name} is {type(mod).__name__}; only nn.Linear can be {style}")
    if style == "vocab_embedding" and type(mod) is not nn.Embedding:
        raise ConfigError(f"tp_plan: {name} is {type(mod).__name__}; only nn.Embedding can be vocab_embedding")
    if style in NORM_STYLES and not all(hasattr(mod, a) for a in ("weight", "eps", "_k")):
        raise ConfigError(f"tp_plan: {name} is {type(mod).__name__}; {style} needs an RMSNorm "
                          "(weight, eps and the backend's kernels)")
    if style in ("colwise", "colwise_in_region", "vocab_head", "vocab_head_in_region"):
        return ColumnParallelLinear(mod.weight, tp, enter_region=style in ("colwise", "vocab_head"),
                                    full_bias=mod.bias)
    if style == "rowwise":
        return RowParallelLinear(mod.weight, tp, full_bias=mod.bias)
    if style == "vocab_embedding":
        return VocabParallelEmbedding(mod.weight, tp)
    if style == "region_norm":
        return TPRegionNorm(mod, tp)
    if style == "head_norm" or (style == "sequence_norm" and tp.sequence_parallel):
        return TPHeadNorm(mod, tp)
    if style == "sequence_gathered" and tp.sequence_parallel:
        gather_sequence_around(mod, tp)
    return None


def apply_plan(model: nn.Module, plan: dict[str, str], *, tp: TPContext) -> nn.Module:
    """Apply a model family's tensor-parallel ``plan`` (module-name pattern -> style, see
    :data:`chipset.models.family.PLAN_STYLES`) to ``model`` in place. Parameter names stay the same.

    The model holds the full, single-process weights; each rank keeps its slice. A Parameter
    shared by two split modules (tied input and output embeddings) stays shared: both split it
    the same way. A ``vocab_head`` holds the vocabulary-parallel cross-entropy over its split
    logits (:func:`vocab_parallel_loss` finds it); nothing is added to ``model`` itself.
    """
    if tp.size == 1:
        return model
    unknown = sorted({s for s in plan.values() if s not in PLAN_STYLES})
    if unknown:
        raise ConfigError(f"tp_plan styles {', '.join(unknown)}: expected one of {', '.join(PLAN_STYLES)}")
    shared: dict[int, nn.Parameter] = {}  # id of an original weight -> its split
    for name, style in plan_matches(model, plan).items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        new = _split(name, old, style, tp)
        if new is None:
            continue
        if style in VOCAB_STYLES:
            key = id(old.weight)
            if key in shared:
                new.weight = shared[key]
            shared[key] = new.weight
        if style in ("vocab_head", "vocab_head_in_region"):
            new.vocab_loss = _VocabParallelLoss(tp, old.out_features)
        setattr(parent, leaf, new)
    return model


def vocab_parallel_loss(model: nn.Module):
    """The cross-entropy over the split logits of ``model``'s tensor-parallel vocab head
    (``loss(logits [n, vocab/tp], targets [n])``; its ``tp`` and ``vocab_size`` say how they
    are split), or None when no plan split its logits over the vocabulary."""
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear) and m.vocab_loss is not None:
            return m.vocab_loss
    return None


def is_tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is one rank's slice of a tensor-parallel parameter."""
    return tp_shard(p) is not None


def logical_slice(p: torch.Tensor) -> tuple[int, int, int, tuple[int, ...]] | None:
    """Where this rank's slice of a tp-sharded parameter sits in the logical tensor.

    Returns ``(dim, start, length, logical_shape)``: the slice's first ``length`` entries
    along ``dim`` are logical entries ``start .. start+length-1``; any entries after those
    are vocabulary padding (zero, never trained). ``None`` for replicated parameters.
    For checkpoint writers that store logical tensors (resharding across tp degrees).
    """
    shard = tp_shard(p)
    if shard is None:
        return None
    per = p.shape[shard.dim]
    start = shard.rank * per
    length = max(0, min(per, shard.size - start))
    shape = list(p.shape)
    shape[shard.dim] = shard.size
    return shard.dim, start, length, tuple(shape)


@torch.no_grad()
def gather_full_parameters(local: dict[str, torch.Tensor], model: nn.Module, tp: TPContext | None,
                           device: torch.device) -> dict[str, torch.Tensor]:
    """Logical (single-process) tensors by name from this rank's tp slices (collective over tp).

    ``local``: name -> this rank's tensor (e.g. ``DataParallel.full_parameters()`` before
    the gather). Replicated parameters pass through; sharded ones are all-gathered over
    tp along the split dimension and trimmed to the logical size (vocabulary padding dropped). Every tp
    rank returns the same dict, on the device of ``local``'s tensors.
    """
    if tp is None or tp.size == 1:
        return dict(local)
    params = dict(model.named_parameters())
    out = {}
    for name in local:  # same order on every rank: the model's parameter order
        p = params.get(name)
        t = local[name]
        if p is None or not is_tp_sharded(p):
            out[name] = t
            continue
        shard = tp_shard(p)
        full = gather_along(t.to(device), shard.dim, tp.collective, tp.group)
        out[name] = full.narrow(shard.dim, 0, shard.size).to(t.device).clone()
    return out
