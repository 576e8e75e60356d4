"""MoE layers under tensor, sequence and context parallelism.

Tensor parallelism (the transformer family's plan: ``sequence_norm`` in front of each MoE
layer, ``sequence_gathered`` on it; parallel/tensor.py): the experts and the router are *replicated* over
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

from chipset.layers.moe import MoE
from chipset.parallel.context import ContextParallel
from chipset.parallel.tensor import all_gather_along

__all__ = ["apply_cp_moe", "CPRouting"]

_SEQ = 1


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
    for m in model.modules():
        if isinstance(m, MoE):
            m.seq_layout = layout
    return model
