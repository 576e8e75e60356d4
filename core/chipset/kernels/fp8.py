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

A weight may come already quantised (:class:`Fp8Weight`, tensorwise only): ZeRO-3 all-gathers
its weights in FP8 (runtime/data_parallel.py), each rank quantising its shard with the scale of
the whole weight, so the gathered bytes are exactly what ``quantize`` makes of the gathered
weight; the forward and the input gradient use them as they are, and the weight gradient,
which never reads the weight, is unchanged.

A backend running real FP8 hardware quantises exactly so (the scales and the rounding are the
specification) and differs from this emulation only in how the products are summed, which the
conformance check allows for (core/chipset/conformance/tests/parallel/test_fp8.py).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_SCALINGS", "Fp8Weight", "fp8_gemm", "fp8_matmul", "quantize", "quantize_with", "tensorwise_scale"]

FP8_SCALINGS = ("tensorwise", "rowwise")
"""How an FP8 GEMM scales its operands (module docstring)."""
FORWARD_FORMAT = torch.float8_e4m3fn
GRADIENT_FORMAT = torch.float8_e5m2
_TINY = 1e-12


class Fp8Weight:
    """A weight already quantised tensorwise to ``float8_e4m3fn``: ``data`` (FP8, the weight's
    shape) and ``scale`` (float32, one element: ``weight ~= data / scale``), what :func:`quantize`
    makes of ``param``'s values. ``param`` is the weight itself, through which its gradient flows
    (its values are not read: under ZeRO-3 they are not even gathered). ``fp8_matmul`` takes it in
    place of ``w``; :func:`quantize` returns ``(data, scale)`` for it without quantising again."""

    scaling = "tensorwise"
    fmt = FORWARD_FORMAT

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, param: torch.Tensor | None = None):
        if data.dtype != self.fmt or scale.numel() != 1 or (param is not None and data.shape != param.shape):
            raise ValueError(
                f"Fp8Weight: expected {self.fmt} data shaped like the weight "
                f"{tuple(param.shape) if param is not None else ''} and one scale; found {data.dtype} "
                f"{tuple(data.shape)} and {scale.numel()} scales")
        self.data, self.scale, self.param = data, scale, param

    def t(self) -> Fp8Weight:
        """The transpose, for the GEMM's operand (a tensorwise scale is the same for it)."""
        return Fp8Weight(self.data.t(), self.scale)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def tensorwise_scale(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The tensorwise scale ``FMAX / amax`` (float32) of a tensor whose largest magnitude is
    ``amax`` (elementwise over a vector of amaxes: one scale per tensor)."""
    return torch.finfo(fmt).max / amax.float().clamp(min=_TINY)


def quantize_with(t: torch.Tensor, s: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``t`` in FP8 format ``fmt`` under the scale ``s``: ``clamp(t * s, -FMAX, FMAX)`` rounded.
    Elementwise, so a shard quantised with the whole tensor's scale gives that slice of the whole."""
    fmax = torch.finfo(fmt).max
    return (t.float() * s).clamp(-fmax, fmax).to(fmt)


def quantize(t, fmt: torch.dtype, scaling: str, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``t`` in FP8 format ``fmt`` and its float32 scale (``t ~= q / s``), scaled along
    ``dim`` (the GEMM's contraction dimension: ``rowwise`` gives one scale per slice across it).
    An :class:`Fp8Weight` is returned as it is (it must be in ``fmt`` and ``scaling``)."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: expected one of {', '.join(FP8_SCALINGS)}")
    if isinstance(t, Fp8Weight):
        if (fmt, scaling) != (t.fmt, t.scaling):
            raise ValueError(f"an Fp8Weight is {t.fmt} with {t.scaling} scaling; this GEMM asks {fmt} with "
                             f"{scaling} scaling: pass the weight itself")
        return t.data, t.scale
    tf = t.float()
    amax = tf.abs().amax() if scaling == "tensorwise" else tf.abs().amax(dim=dim, keepdim=True)
    s = tensorwise_scale(amax, fmt)
    return quantize_with(tf, s, fmt), s


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
    def forward(ctx, x2, w, scaling, gemm, wq_data, wq_scale):
        # A pre-quantised weight saves its FP8 bytes (ZeRO-3 re-gathers them for backward), not w.
        ctx.save_for_backward(x2, w if wq_data is None else wq_data, wq_scale)
        ctx.scaling, ctx.gemm, ctx.w_dtype, ctx.pre = scaling, gemm, w.dtype, wq_data is not None
        b = w if wq_data is None else Fp8Weight(wq_data, wq_scale, w)
        return gemm(x2, b.t(), scaling, FORWARD_FORMAT, FORWARD_FORMAT, x2.dtype)

    @staticmethod
    def backward(ctx, g):
        x2, w, wq_scale = ctx.saved_tensors
        s, gemm = ctx.scaling, ctx.gemm
        if ctx.pre:
            w = Fp8Weight(w, wq_scale)
        dx = gemm(g, w, s, GRADIENT_FORMAT, FORWARD_FORMAT, x2.dtype) if ctx.needs_input_grad[0] else None
        dw = gemm(g.t(), x2, s, GRADIENT_FORMAT, FORWARD_FORMAT, ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


def fp8_matmul(x: torch.Tensor, w, scaling: str = "tensorwise", *, gemm=fp8_gemm) -> torch.Tensor:
    """``x @ w.T`` with FP8 operands (module docstring): ``x [..., K]``, ``w [N, K]`` -> ``[..., N]``
    in ``x``'s dtype; differentiable in both. ``w`` may be an :class:`Fp8Weight` (tensorwise
    only): its bytes are used as they are, its ``param`` gets the gradient. ``gemm``: the
    one-GEMM primitive, with :func:`fp8_gemm`'s signature (a backend passes its hardware's; the
    forward and backward around it are this function's)."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: expected one of {', '.join(FP8_SCALINGS)}")
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, Fp8Weight):
        if scaling != w.scaling:
            raise ValueError(f"an Fp8Weight is quantised {w.scaling}; fp8_matmul was asked for {scaling} scaling")
        y = _Fp8Linear.apply(x2, w.param, scaling, gemm, w.data, w.scale)
    else:
        y = _Fp8Linear.apply(x2, w, scaling, gemm, None, None)
    return y.reshape(*x.shape[:-1], w.shape[0])
