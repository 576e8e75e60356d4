"""The grouped-GEMM slot behind MoE experts: the cpu backend's one-call kernel against the
reference loop, including a backward from ``y.sum()`` (an expanded, stride-0 gradient that
torch._grouped_mm's own backward refuses), and a MoE layer routed through it."""

from __future__ import annotations

import pytest
import torch

from chipset.kernels.reference import grouped_mm as reference

cpu_kernels = pytest.importorskip("chipset_cpu.kernels")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_cpu_grouped_mm_equals_the_loop_forward_and_backward_from_a_sum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 16, generator=g).transpose(1, 2).requires_grad_(True)  # as MoE passes its weights
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # an empty middle group
    assert cpu_kernels.grouped_mm_available(x, w, offs)
    y = cpu_kernels.grouped_mm(x, w, offs)
    y.sum().backward()
    got = (y.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    want = reference(x, w, offs)
    want.sum().backward()
    # fp32 dot products of 16 (forward) and of at most 7 rows (weight gradient): a few ulps
    for a, b in zip(got, (want.detach(), x.grad, w.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=16 * torch.finfo(torch.float32).eps, atol=1e-6)



def test_cpu_grouped_mm_is_chosen_when_first_asked_under_compile_and_no_grad():
    """The cpu backend asks once whether this torch runs the op (forward and backward). If the first
    MoE layer to ask is being compiled under no_grad (an evaluation before training), the answer
    is still this torch's, and the compiled code has no graph break."""
    cpu_kernels._cpu_grouped_mm.forget()  # as in a fresh process: not asked yet
    x, w = torch.ones(8, 4), torch.ones(2, 4, 4)
    offs = torch.tensor([3, 8], dtype=torch.int32)

    def layer(x, w, offs):
        return x * 2 if cpu_kernels.grouped_mm_available(x, w, offs) else x - 1

    with torch.no_grad():
        out = torch.compile(layer, backend="eager", fullgraph=True)(x, w, offs)
    assert out.eq(2.0 if hasattr(torch, "_grouped_mm") else 0.0).all()

def _bound(x, w, offs, n):
    """Per-element error bound of a float32 grouped product whose dot products add ``n`` terms
    (ordered any way): n * eps * (|x| @ |w|) per group, through the reference on absolute values."""
    return n * torch.finfo(torch.float32).eps * reference(x.abs(), w.abs(), offs)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("align", [1, 8])
def test_padded_groups_give_the_loop_forward_and_backward(align):
    """chipset.kernels.grouped pads each group to ``align`` rows (the cuda backend asks for 8: its
    kernel's 16-byte rule on the rows it splits); the padding rows add nothing, in any gradient."""
    from chipset.kernels import grouped

    g = torch.Generator().manual_seed(1)
    sizes = [5, 0, 13, 3]  # none a multiple of 8, an empty group
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = torch.randn(sum(sizes), 16, generator=g, requires_grad=True)
    w = torch.randn(4, 24, 16, generator=g).transpose(1, 2).requires_grad_(True)  # as MoE passes its weights
    up = torch.randn(sum(sizes), 24, generator=g)
    y = grouped.grouped_mm(x, w, offs, align_rows=align)
    y.backward(up)
    got = (y.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    want = reference(x, w, offs)
    want.backward(up)
    xd, wd = x.detach(), w.detach()
    # Forward: dot products of 16; input gradient: of 24 (up @ w^T); weight gradient: of a group's
    # rows, at most 13 real ones (16 with padding, which adds exact zeros).
    assert (got[0] - want.detach()).abs().le(_bound(xd, wd, offs, 16)).all()
    assert (got[1] - x.grad).abs().le(_bound(up, wd.transpose(1, 2), offs, 24)).all()
    w_bound = torch.stack([16 * torch.finfo(torch.float32).eps * (xd[a:b].abs().t() @ up[a:b].abs())
                           for a, b in zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True)])
    assert (got[2] - w.grad).abs().le(w_bound).all()
    assert got[2][1].eq(0).all()  # the empty group's weights get no gradient
