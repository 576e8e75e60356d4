"""MoE layers under tensor, sequence and context parallelism.

Tensor parallelism (``apply_tp_moe``): the experts and the router are *replicated* over
the tp ranks, not split. Without sequence parallelism every tp rank holds the same
tokens, so each computes the same routing and the same expert outputs, and the gradients
reaching the MoE (and leaving it) are the full ones on every rank: the router and expert
gradients come out identical across tp and need no tp reduction, and the norm in front
of the MoE stays a plain norm (no tp region to enter). Splitting each expert Megatron-style
would save expert memory and FLOPs per rank but costs two collectives per MoE layer and
makes a token's expert output depend on a tp reduction; expert parallelism is the
intended way to spread expert weights. With ``ep`` the all-to-all runs inside each ep
group, which holds one tp index (``ParallelDims``), so tp ranks exchange nothing extra.

Sequence parallelism: tokens are split over tp along the sequence, while the router's
capacity and the load-balancing loss are defined per whole sequence. The MoE's input is
all-gathered over tp (forward) and its output cut back to this rank's slice; the slice's
backward all-gathers the output gradient and the gather's backward keeps this rank's
slice. So inside the MoE every tp rank runs the same whole-sequence forward and backward,
as without sp (one all-gather each way per MoE layer). The norm in front runs on the slice,
so its (replicated) weight's gradient is all-reduced over tp as in ``TPRegionNorm``.

Context parallelism (``apply_cp_moe``): each cp rank runs its own tokens through the
experts; only the router's logits ``[b, s/cp, E]`` are all-gathered over cp (backward:
reduce-scatter), put into sequence order and routed whole, and each rank keeps the
decisions for its tokens. Capacity dropping therefore equals one process; the aux loss
is the whole sequences' on every cp rank, and since DataParallel averages the gradients
and the reported loss over dp x cp, it enters the objective exactly once. Expert
gradients are reduced over dp x cp (edp with ep) like every other parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from chipset.engine.context_parallel import ContextParallel
from chipset.engine.tensor_parallel import TPContext, all_gather_along, copy_to_group, gather_along
from chipset.models.moe import MoE

__all__ = ["apply_tp_moe", "apply_cp_moe", "CPRouting"]

_SEQ = 1


class _GatherSeqKeepSlice(torch.autograd.Function):
    """All-gather along the sequence forward; backward keeps this rank's slice of a gradient
    that every rank holds whole (the MoE's backward is replicated over tp)."""

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


class SeqParallelNorm(nn.Module):
    """RMSNorm on this rank's sequence slice whose replicated weight's gradient is summed over tp."""

    def __init__(self, norm: nn.Module, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = norm.weight  # same Parameter: name and init kept
        self.eps = norm.eps
        self._k = norm._k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x, copy_to_group(self.weight, self.tp.collective, self.tp.group), self.eps)


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [b for b in model.layers if isinstance(b.mlp, MoE)]


def apply_tp_moe(model: nn.Module, *, tp: TPContext) -> nn.Module:
    """Replicate the MoE layers over tp (after :func:`~chipset.engine.tensor_parallel.apply_tp`,
    which leaves MoE blocks' MLP side alone). Only sequence parallelism needs anything here."""
    if tp.size == 1 or not tp.sequence_parallel:
        return model
    for block in _moe_blocks(model):
        block.post_attention_layernorm = SeqParallelNorm(block.post_attention_layernorm, tp)
        block.mlp.register_forward_pre_hook(lambda _m, args, tp=tp: (_GatherSeqKeepSlice.apply(args[0], tp),))
        block.mlp.register_forward_hook(lambda _m, _args, y, tp=tp: _SliceSeqGatherGrad.apply(y, tp))
    return model


class CPRouting:
    """``MoE.seq_layout`` under context parallelism: gather the router's logits into sequence order."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp
        self._order: dict[tuple[int, str], torch.Tensor] = {}

    def full(self, t: torch.Tensor) -> torch.Tensor:
        cp = self.cp
        g = all_gather_along(t, _SEQ, cp.collective, cp.group)  # rank-major: each rank's two chunks
        s = g.shape[_SEQ]
        key = (s, str(g.device))
        if key not in self._order:
            pos = torch.cat([cp.positions_of(r, s, g.device) for r in range(cp.size)])
            self._order[key] = torch.argsort(pos)
        return g.index_select(_SEQ, self._order[key])

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return self.cp.local(t)


def apply_cp_moe(model: nn.Module, *, cp: ContextParallel) -> nn.Module:
    """Route whole sequences in every MoE layer although each cp rank holds a share of them."""
    if cp.size == 1:
        return model
    layout = CPRouting(cp)
    for block in _moe_blocks(model):
        block.mlp.seq_layout = layout
    return model
