"""The FP8 GEMM's numerics: the reference every backend's ``fp8_matmul`` is certified against.

``fp8_matmul(x, w, scaling)`` is ``x @ w.T`` (a linear layer's product: ``x [..., K]``, ``w [N, K]``)
with both operands quantised to ``float8_e4m3fn`` first, as FP8 training recipes (torchao's Float8,
Transformer Engine) compute it. One GEMM ``a @ b`` (``a [M, K]``, ``b [K, N]``) is:

* each operand scaled along the contraction dimension ``K``: ``tensorwise`` one scale per
  operand, ``rowwise`` one per row of ``a`` and one per column of ``b``;
  ``s = FMAX / amax(|t|)`` in float32 (``FMAX`` the format's largest finite value, 448 for e4m3,
  ``amax`` at least 1e-12 so an all-zero operand quantises to zeros);
* ``q = clamp(t * s, -FMAX, FMAX)`` rounded to the format (round to nearest even);
* ``out = (q_a @ q_b) / (s_a s_b)``, accumulated in float32 (float64 when the inputs are float64:
  the conformance suite's exact answer), returned in the input dtype.

The backward runs two more such GEMMs, with the incoming gradient quantised to ``float8_e5m2``
(wider range, for gradients): ``dx = g @ w`` and ``dw = g^T @ x``, each operand scaled along that
GEMM's own contraction dimension. The weights stay in the run's dtype (the master copy); only
the GEMMs see FP8.

A backend running real FP8 hardware quantises exactly so (the scales and the rounding are the
specification) and differs from this emulation only in how the products are summed, which the
conformance check allows for (core/chipset/conformance/tests/parallel/test_fp8.py).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_SCALINGS", "fp8_gemm", "fp8_matmul", "quantize"]

FP8_SCALINGS = ("tensorwise", "rowwise")
"""How an FP8 GEMM scales its operands (module docstring)."""
FORWARD_FORMAT = torch.float8_e4m3fn
GRADIENT_FORMAT = torch.float8_e5m2
_TINY = 1e-12


def quantize(t: torch.Tensor, fmt: torch.dtype, scaling: str, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``t`` in FP8 format ``fmt`` and its float32 scale (``t ~= q / s``), scaled along
    ``dim`` (the GEMM's contraction dimension: ``rowwise`` gives one scale per slice across it)."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: expected one of {', '.join(FP8_SCALINGS)}")
    tf = t.float()
    fmax = torch.finfo(fmt).max
    amax = tf.abs().amax() if scaling == "tensorwise" else tf.abs().amax(dim=dim, keepdim=True)
    s = fmax / amax.clamp(min=_TINY)
    return (tf * s).clamp(-fmax, fmax).to(fmt), s


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scaling: str, fmt_a: torch.dtype, fmt_b: torch.dtype,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (``[M, K] @ [K, N]``) through FP8 operands (module docstring), emulated: the
    quantised values dequantised and multiplied in float32 (float64 for float64 inputs)."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    qa, sa = quantize(a, fmt_a, scaling, dim=1)
    qb, sb = quantize(b, fmt_b, scaling, dim=0)
    return ((qa.to(acc) / sa.to(acc)) @ (qb.to(acc) / sb.to(acc))).to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, scaling, gemm):
        ctx.save_for_backward(x2, w)
        ctx.scaling, ctx.gemm = scaling, gemm
        return gemm(x2, w.t(), scaling, FORWARD_FORMAT, FORWARD_FORMAT, x2.dtype)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        s, gemm = ctx.scaling, ctx.gemm
        dx = gemm(g, w, s, GRADIENT_FORMAT, FORWARD_FORMAT, x2.dtype) if ctx.needs_input_grad[0] else None
        dw = gemm(g.t(), x2, s, GRADIENT_FORMAT, FORWARD_FORMAT, w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scaling: str = "tensorwise", *, gemm=fp8_gemm) -> torch.Tensor:
    """``x @ w.T`` with FP8 operands (module docstring): ``x [..., K]``, ``w [N, K]`` -> ``[..., N]``
    in ``x``'s dtype; differentiable in both. ``gemm``: the one-GEMM primitive, with
    :func:`fp8_gemm`'s signature (a backend passes its hardware's; the forward and backward
    around it are this function's)."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: expected one of {', '.join(FP8_SCALINGS)}")
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), w, scaling, gemm)
    return y.reshape(*x.shape[:-1], w.shape[0])
