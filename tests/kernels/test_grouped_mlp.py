"""The cpu backend's ``grouped_mlp`` (each MoE expert's SwiGLU MLP in one pass over its rows, one
autograd node) equals the layer's unfused path (grouped GEMM, the backend's swiglu, grouped GEMM)
forward and in every gradient, with an empty group, from a random and from an expanded
(``y.sum()``) output gradient, and with frozen weights; its predicate refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch

import parity
from chipset.kernels.reference import grouped_mm

cpu_kernels = pytest.importorskip("chipset_cpu.kernels")

HIDDEN, FFN, OUT = 16, 24, 16
COUNTS = (5, 0, 9)  # an empty middle group
# Longest chain of reductions behind any result: the gate GEMM (HIDDEN terms), dh (OUT) and dx
# or a weight gradient (FFN or a group's rows): 3 reductions of at most 24 terms.
RTOL = parity.reduction_rtol(max(HIDDEN, FFN, OUT, *COUNTS), 3)


def _inputs(weights_grad: bool = True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), HIDDEN, generator=g).requires_grad_(True)
    # As MoE passes them: transposed views of [experts, out, in] parameters.
    ws = [(torch.randn(len(COUNTS), o, i, generator=g) * 0.3).requires_grad_(weights_grad).transpose(1, 2)
          for o, i in ((FFN, HIDDEN), (FFN, HIDDEN), (OUT, FFN))]
    offs = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, ws, offs


def _unfused(x, w_gate, w_up, w_down, offs):
    return grouped_mm(cpu_kernels.swiglu(grouped_mm(x, w_gate, offs), grouped_mm(x, w_up, offs)), w_down, offs)


def _results(fn, x, ws, offs, upstream):
    leaves = [x, *(w._base for w in ws if w.requires_grad)]
    y = fn(x, *ws, offs)
    return [y.detach(), *torch.autograd.grad((y * upstream).sum() if upstream is not None else y.sum(), leaves)]


@pytest.mark.parametrize("upstream", ["random", "sum"])
@pytest.mark.parametrize("weights_grad", [True, False], ids=["trained", "frozen"])
def test_cpu_grouped_mlp_equals_the_unfused_experts(upstream, weights_grad):
    x, ws, offs = _inputs(weights_grad)
    assert cpu_kernels.grouped_mlp_available(x, *ws, offs)
    dy = torch.randn(sum(COUNTS), OUT, generator=torch.Generator().manual_seed(1)) if upstream == "random" else None
    got = _results(cpu_kernels.grouped_mlp, x, ws, offs, dy)
    want = _results(_unfused, x, ws, offs, dy)
    assert len(got) == (5 if weights_grad else 2)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and a.is_contiguous()
        err = float((a - b).norm() / b.norm())
        assert err <= RTOL, f"result {i}: relative difference {err:.2e} > {RTOL:.2e}"
    for dw in got[2:]:
        assert not dw[1].any()  # the empty group's weights get exactly no gradient


def test_cpu_grouped_mlp_predicate_refuses_what_it_does_not_compute():
    x, ws, offs = _inputs()
    ok = cpu_kernels.grouped_mlp_available
    assert not ok(x.bfloat16(), *(w.bfloat16() for w in ws), offs)  # 16-bit: the reference's roundings
    assert not ok(x, *ws, offs.long())
    assert not ok(x, *ws, offs - 1)  # rows past the last group
    assert not ok(x, ws[0], ws[1][:, :, :-1], ws[2], offs)  # up narrower than gate
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the unfused GEMMs would run in bfloat16
        assert not ok(x, *ws, offs)
