"""Expert parallelism: shard MoE experts over the ep ranks and move tokens with all-to-all.

Layout (see :class:`~chipset.parallel.dims.ParallelDims`): ep groups are carved
out of the data-parallel ranks, ep fastest, so ``dp = ep * edp``. Every rank keeps its
own tokens (data parallel as usual); the ``E`` experts of each MoE layer are split into
``ep`` contiguous blocks, expert ``e`` living on ep rank ``e // (E / ep)``. Non-expert
parameters are replicated over all dp ranks and reduced over dp; expert parameters are
replicated over the ``edp`` ranks holding the same block (the expert-data-parallel
group) and reduced over it. Gradients of both are divided by the full dp degree: an
expert's gradient already sums the contributions of every token of its ep group.

Dispatch (per MoE layer, forward): the layer sorts its kept assignments by global expert
id; the per-expert counts are exchanged with one all-to-all, the tokens with a second
(uneven splits: ``input_split[r]`` = assignments for rank r's experts); received tokens
are regrouped by local expert (source-rank order inside each), run through the local
experts, put back in arrival order and returned with the inverse all-to-all. Backward
runs the same all-to-alls with the splits swapped (:class:`_AllToAll`).

Parameters keep their single-process names; an ep-sharded expert tensor holds rows
``[ep_rank * E_local, (ep_rank + 1) * E_local)`` of the logical ``[E, ...]`` tensor.
:func:`gather_expert_params` rebuilds logical tensors and :func:`shard_expert_tensor` cuts
one back, which is what params_digest and resharding checkpoints need.
"""

from __future__ import annotations

import torch
from torch import nn

from chipset.errors import ConfigError
from chipset.interfaces import Collective, Group
from chipset.layers.moe import Experts, MoE
from chipset.parallel.dims import ParallelDims

__all__ = ["apply_ep", "AllToAllDispatcher", "expert_param_names", "gather_expert_params", "shard_expert_tensor"]


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all along dim 0; backward sends gradients back with swapped splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, collective, group):  # noqa: ANN001
        ctx.splits = (out_splits, in_splits)
        ctx.collective, ctx.group = collective, group
        return _all_to_all(x.contiguous(), out_splits, in_splits, collective, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.collective, ctx.group), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], collective: Collective,
                group: Group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    collective.all_to_all(out, x, out_splits, in_splits, group=group)
    return out


class AllToAllDispatcher:
    """Runs the assignments of one MoE layer on the ep ranks that own their experts."""

    def __init__(self, collective: Collective, group: Group, ep: int, ep_rank: int, num_experts: int):
        self.collective, self.group = collective, group
        self.ep, self.ep_rank = ep, ep_rank
        self.local = num_experts // ep

    def __call__(self, tokens: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
        ep, local = self.ep, self.local
        # counts[e] for every global expert -> what each source rank sends to each of my experts.
        send_counts = torch.tensor(counts, dtype=torch.int64, device=tokens.device)
        recv_counts = torch.empty_like(send_counts)
        self.collective.all_to_all(recv_counts, send_counts, group=self.group)
        recv = recv_counts.view(ep, local).tolist()  # recv[src][e_local]
        in_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
        out_splits = [sum(row) for row in recv]
        arrived = _AllToAll.apply(tokens, out_splits, in_splits, self.collective, self.group)
        # Arrival order is (source, local expert) blocks; the experts want (local expert, source):
        # a stable sort by the block's key e*ep + src.
        key = torch.arange(local * ep, device=tokens.device).view(local, ep).t().reshape(-1)
        perm = torch.argsort(torch.repeat_interleave(key, recv_counts), stable=True)
        per_expert = [sum(recv[src][e] for src in range(ep)) for e in range(local)]
        done = experts(arrived[perm], per_expert)
        back = torch.empty_like(done).index_copy(0, perm, done)  # arrival order again
        return _AllToAll.apply(back, in_splits, out_splits, self.collective, self.group)


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (single-process) of every expert weight: sharded by ep, reduced over edp."""
    return {f"{n}.experts.{p}" for n, m in _moe_layers(model) for p, _ in m.experts.named_parameters()}


@torch.no_grad()
def apply_ep(model: nn.Module, *, dims: ParallelDims, collective: Collective) -> nn.Module:
    """Keep this rank's block of experts in every MoE layer and install the all-to-all dispatcher.

    Call on the fully initialised single-process model (so every layout starts from the
    same weights), before the data-parallel engine wraps it. Collective: every rank of the
    job must call it (it creates the ep groups).
    """
    layers = _moe_layers(model)
    if not dims.ep_enabled:
        return model
    if not layers:
        raise ConfigError(f"parallel.ep = {dims.ep} but the model has no MoE layers; set model.num_experts")
    group = dims.group("ep", collective)
    ep_rank = group.ranks.index(collective.rank())
    for name, moe in layers:
        if moe.num_experts % dims.ep:
            raise ConfigError(f"{name}: ep ({dims.ep}) must divide num_experts ({moe.num_experts})")
        local = moe.num_experts // dims.ep
        ex = moe.experts
        for p in list(ex.parameters()):
            p.data = shard_expert_tensor(p.data, ep_rank, dims.ep).clone()
        ex.first = ep_rank * local
        moe.dispatcher = AllToAllDispatcher(collective, group, dims.ep, ep_rank, moe.num_experts)
    return model


def shard_expert_tensor(full: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    """This ep rank's rows of a logical ``[E, ...]`` expert tensor (a view)."""
    local = full.shape[0] // ep
    return full[ep_rank * local:(ep_rank + 1) * local]


@torch.no_grad()
def gather_expert_params(params: dict[str, torch.Tensor], model: nn.Module, *, dims: ParallelDims,
                         collective: Collective) -> dict[str, torch.Tensor]:
    """Replace ep-sharded expert tensors in ``params`` by the logical full ones (collective over ep).

    ``params`` maps single-process names to this rank's tensors (as ``full_parameters``
    returns them; all of the model's or one bucket's); the result has every tensor at its
    single-process shape. Every ep rank passes the same names.
    """
    if not dims.ep_enabled:
        return params
    group = dims.group("ep", collective)
    out = dict(params)
    for name in sorted(n for n in expert_param_names(model) if n in params):
        local = params[name]
        dev_local = local.to(model_device(model))
        full = dev_local.new_empty((local.shape[0] * dims.ep, *local.shape[1:]))
        collective.all_gather(full, dev_local.contiguous(), group=group)
        out[name] = full.to(local.device)
    return out


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
