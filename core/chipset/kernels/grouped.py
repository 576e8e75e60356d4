"""``torch._grouped_mm`` as the body of a backend's ``grouped_mm`` kernel: all of a MoE layer's
experts in one call, with the reference's semantics (:func:`chipset.kernels.reference.grouped_mm`).

Shared by the backends that register it, so each keeps only its predicate (device, dtype, what
its torch build runs). Two things the bare op does not do:

- its backward refuses an expanded upstream gradient (stride 0, as ``y.sum()`` gives): the
  unpadded call's output passes through an identity whose backward hands on a contiguous one
  (the padded call's gather does that already);
- a device kernel may need each group's rows to start at an aligned offset (its weight gradient
  splits the rows between groups, and a tile load wants 16-byte aligned starts): with
  ``align_rows`` > 1 every group is padded with zero rows to a multiple of it, the op runs on the
  padded rows and the real rows are gathered back. The padding adds nothing to any product or
  gradient. The padded buffer is sized by an upper bound (rows + groups x (align_rows - 1)), so
  padding reads no group size back to the host; the rows past the last padded group are never
  read.
"""

from __future__ import annotations

import torch

__all__ = ["accepts", "grouped_mm"]


def accepts(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> bool:
    """Whether the op takes these arguments (the device and dtype are the backend's to check):
    ``x`` [T, in] and ``w`` [groups, in, out] of one dtype, ``offs`` int32 [groups], and the op's
    16-byte stride rule: the input's row length and both of the weights' trailing sizes are
    multiples of 16 bytes (the weights may be a transposed view)."""
    if x.dim() != 2 or w.dim() != 3 or w.dtype != x.dtype or offs.dtype != torch.int32 or offs.dim() != 1:
        return False
    if offs.shape[0] != w.shape[0] or x.shape[1] != w.shape[1]:
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-1], w.shape[-2]))


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, align_rows: int = 1) -> torch.Tensor:
    """``x`` [T, in], ``w`` [groups, in, out], ``offs`` int32 cumulative group ends: [T, out]."""
    if align_rows <= 1:
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    groups, rows = offs.shape[0], x.shape[0]
    ends = offs.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + align_rows - 1) // align_rows * align_rows
    padded_ends = padded.cumsum(0)
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), sizes, output_size=rows)
    # Row i of group g moves from ends[g] - sizes[g] + j to padded_ends[g] - padded[g] + j.
    shift = (padded_ends - padded) - (ends - sizes)
    dest = torch.arange(rows, device=x.device) + shift[group]
    xp = x.new_zeros(rows + groups * (align_rows - 1), x.shape[1]).index_copy(0, dest, x)
    yp = torch._grouped_mm(xp, w, offs=padded_ends.to(torch.int32))
    return yp.index_select(0, dest)  # its backward hands the op a fresh, contiguous gradient
