"""Triton kernels (forward and backward) for rms_norm, rotary_embedding, swiglu, cross_entropy.

Imported only when a kernel is first used (``chipset_cuda.kernels``); importing this
module imports triton. Each public function takes the core reference's arguments and is
a ``torch.autograd.Function``, so gradients flow through the Triton backward.

Numerics: math is done in float32 and, for the elementwise kernels, rounded to the
input dtype at the same points the core reference (eager torch) rounds, so results
match the reference to within one rounding in bf16/fp16. Under ``TRITON_INTERPRET=1``
the same kernels run on CPU tensors (the project's tests do this).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rotary_embedding", "swiglu", "cross_entropy", "MAX_ROW", "CE_BLOCK"]

MAX_ROW = 16384
"""Longest last dim rms_norm keeps in one program (a row lives in registers)."""
CE_BLOCK = 4096
"""Vocabulary chunk cross_entropy streams through per step (tests shrink it)."""
_ELEMENTWISE_BLOCK = 1024


def _on(t: torch.Tensor):
    # Triton launches on the *current* CUDA device, not the tensor's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _programs(t: torch.Tensor, rows: int) -> int:
    """Programs for row-reduction backward passes (each accumulates a partial weight grad)."""
    if t.is_cuda:
        sms = torch.cuda.get_device_properties(t.device).multi_processor_count
        return max(1, min(rows, 4 * sms))
    return max(1, min(rows, 4))  # interpreter: few programs keep it fast


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


# --- rms_norm ------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    y = (x * rstd).to(X.dtype.element_ty)  # the reference rounds the normalised x first
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * w).to(Y.dtype.element_ty)
    tl.store(Y + row * N + cols, y, mask=mask)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW, N, n_rows, rows_per_prog, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for r in range(start, end):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        if HAS_W:
            y = xhat.to(X.dtype.element_ty).to(tl.float32)
            dw += (dy * y).to(DY.dtype.element_ty).to(tl.float32)  # product in the output dtype
            g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
        else:
            g = dy
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        # As in the reference, a weight of another dtype (fp32 under autocast) promotes the output.
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        has_w = weight is not None
        w = weight.contiguous() if has_w else x2
        with _on(x):
            _rms_norm_fwd[(x2.shape[0],)](x2, w, y, rstd, n, eps, HAS_W=has_w, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, w, rstd)
        ctx.has_w, ctx.shape, ctx.block = has_w, x.shape, block
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = dy.reshape(rows, n).contiguous()  # in the output dtype
        dx = torch.empty_like(x2)
        progs = _programs(x2, rows)
        per = triton.cdiv(rows, progs)
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device) if ctx.has_w else rstd
        with _on(x2):
            _rms_norm_bwd[(progs,)](dy2, x2, w, rstd, dx, dw_part, n, rows, per,
                                    HAS_W=ctx.has_w, BLOCK=ctx.block, num_warps=_warps(ctx.block))
        dw = dw_part.sum(0).to(w.dtype) if ctx.has_w else None
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Triton rms_norm with the reference's signature, rounding and dtype promotion."""
    return _RMSNorm.apply(x, weight, eps)


# --- rotary_embedding ----------------------------------------------------------------
@triton.jit
def _rope(X, COS, SIN, Y, S, D, HALF, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = row % S
    c = tl.arange(0, BLOCK)
    m = c < HALF
    ty = Y.dtype.element_ty
    x1 = tl.load(X + row * D + c, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + row * D + HALF + c, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(COS + s * D + c, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + s * D + HALF + c, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + s * D + c, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + s * D + HALF + c, mask=m, other=0.0).to(tl.float32)
    a1 = (x1 * c1).to(ty).to(tl.float32)
    a2 = (x2 * c2).to(ty).to(tl.float32)
    if BACKWARD:  # transpose of the rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        o1 = a1 + (x2 * s2).to(ty).to(tl.float32)
        o2 = a2 - (x1 * s1).to(ty).to(tl.float32)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        o1 = a1 - (x2 * s1).to(ty).to(tl.float32)
        o2 = a2 + (x1 * s2).to(ty).to(tl.float32)
    tl.store(Y + row * D + c, o1.to(ty), mask=m)
    tl.store(Y + row * D + HALF + c, o2.to(ty), mask=m)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    s, d = x.shape[-2], x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    cos2 = cos.reshape(s, d).contiguous()
    sin2 = sin.reshape(s, d).contiguous()
    block = triton.next_power_of_2(d // 2)
    with _on(x):
        _rope[(xc.numel() // d,)](xc, cos2, sin2, y, s, d, d // 2, BACKWARD=backward, BLOCK=block,
                                  num_warps=_warps(block))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy, cos, sin, backward=True), None, None


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton rotary embedding; ``cos``/``sin`` must reshape to (seq, head_dim) (no grad)."""
    return _Rotary.apply(x, cos, sin)


# --- swiglu --------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ty = Y.dtype.element_ty
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g).to(ty).to(tl.float32)
    t = (g * sg).to(ty).to(tl.float32)
    tl.store(Y + offs, (t * u).to(ty), mask=m)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    # Mirrors autograd of the reference ``gate * sigmoid(gate) * up``, rounding where it rounds.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ty = DG.dtype.element_ty
    dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g).to(ty).to(tl.float32)
    t = (g * sg).to(ty).to(tl.float32)
    dt = (dy * u).to(ty).to(tl.float32)
    du = dy * t
    dg_direct = (dt * sg).to(ty).to(tl.float32)
    dsg = (dt * g).to(ty).to(tl.float32)
    dg_sig = (dsg * (1.0 - sg) * sg).to(ty).to(tl.float32)
    tl.store(DG + offs, (dg_direct + dg_sig).to(ty), mask=m)
    tl.store(DU + offs, du.to(ty), mask=m)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = gate.contiguous(), up.contiguous()
        y = torch.empty_like(g)
        n = g.numel()
        with _on(g):
            _swiglu_fwd[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](g, u, y, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=4)
        ctx.save_for_backward(g, u)
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        with _on(g):
            _swiglu_bwd[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](dy, g, u, dg, du, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=4)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up`` (same shape and dtype for both)."""
    return _SwiGLU.apply(gate, up)


# --- cross_entropy -------------------------------------------------------------------
@triton.jit
def _ce_fwd(LOGITS, TARGET, LOSS, LSE, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * V
    mx = tl.full([], float("-inf"), tl.float32)
    se = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):  # online logsumexp over vocabulary chunks
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new = tl.maximum(mx, tl.max(x, axis=0))
        se = se * tl.exp(mx - new) + tl.sum(tl.exp(x - new), axis=0)
        mx = new
    lse = mx + tl.log(se)
    t = tl.load(TARGET + row).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    picked = tl.load(base + tl.where(in_range, t, 0)).to(tl.float32)
    # An out-of-range target gives NaN (the reference raises); never an out-of-bounds read.
    loss = tl.where(in_range, lse - picked, float("nan"))
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd(LOGITS, TARGET, LSE, DLOSS, DLOGITS, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TARGET + row).to(tl.int64)
    scale = tl.where(t != ignore_index, tl.load(DLOSS + row), 0.0)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        x = tl.load(LOGITS + row * V + cols, mask=m, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
        tl.store(DLOGITS + row * V + cols, grad.to(DLOGITS.dtype.element_ty), mask=m)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):
        lg, tg = logits.contiguous(), target.contiguous()
        rows, v = lg.shape
        loss = torch.empty(rows, dtype=torch.float32, device=lg.device)
        lse = torch.empty_like(loss)
        block = min(CE_BLOCK, triton.next_power_of_2(v))
        with _on(lg):
            _ce_fwd[(rows,)](lg, tg, loss, lse, v, ignore_index, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(lg, tg, lse)
        ctx.ignore_index, ctx.reduction, ctx.block = ignore_index, reduction, block
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        ctx.count = (tg != ignore_index).sum().clamp(min=1)
        return loss.sum() / ctx.count

    @staticmethod
    def backward(ctx, dloss):
        lg, tg, lse = ctx.saved_tensors
        rows, v = lg.shape
        if ctx.reduction == "mean":
            dloss = dloss / ctx.count
        d = dloss.float().expand(rows).contiguous()
        dlogits = torch.empty_like(lg)
        with _on(lg):
            _ce_bwd[(rows,)](lg, tg, lse, d, dlogits, v, ctx.ignore_index, BLOCK=ctx.block, num_warps=_warps(ctx.block))
        return dlogits, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Triton softmax cross-entropy over (N, V) logits; loss in float32 like the reference."""
    return _CrossEntropy.apply(logits, target, ignore_index, reduction)
