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
