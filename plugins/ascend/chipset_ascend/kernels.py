"""chipset kernels on torch_npu's fused operators, each behind an availability predicate.

A predicate says yes only for arguments inside the operator's documented contract
(device, dtypes, shapes, mask kinds); anything else falls back to chipset's
reference implementation, so a call never reaches torch_npu with arguments it
does not accept. Signatures are those of ``chipset.kernels.reference``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

from chipset_ascend._runtime import torch_npu

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF_FLOATS = (torch.float16, torch.bfloat16)

# sparse_mode 2/3/4 of npu_fusion_attention take this optimised (compressed) mask:
# a 2048 x 2048 bool upper triangle (True above the diagonal = masked out).
COMPRESSED_MASK_SIZE = 2048
SPARSE_DEFAULT = 0  # atten_mask used as given (with pre/next_tockens, left at "no band")
SPARSE_RIGHT_DOWN_CAUSAL = 3  # causal aligned bottom-right, as chipset's reference is


# --- rms_norm: torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd) -------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    gamma = weight if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return torch_npu().npu_rms_norm(x, gamma, epsilon=float(eps))[0]


# --- rotary_embedding: torch_npu.npu_rotary_mul(x, r1, r2) = x*r1 + rotate_half(x)*r2 --
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_rotary_mul(x, _as_4d(cos), _as_4d(sin))


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


# --- swiglu: torch_npu.npu_swiglu(x, dim) = silu(first half) * second half -----------
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


# --- scaled_dot_product_attention: torch_npu.npu_fusion_attention ----------------
def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    b, n, sq, d = q.shape
    if k.shape[1] != n:  # grouped-query attention: repeat K/V heads, as the reference does
        rep = n // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    sk = k.shape[2]
    atten_mask, sparse_mode = npu_attention_mask(mask, causal, b, n, sq, sk, q.device)
    out = torch_npu().npu_fusion_attention(
        q, k, v, n, "BNSD",
        atten_mask=atten_mask,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        keep_prob=1.0,
        sparse_mode=sparse_mode,
    )
    return out[0]


_COMPRESSED_MASKS: dict[str, torch.Tensor] = {}


def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    # 4 MiB per device, built once: the operator only reads it.
    key = str(device)
    if key not in _COMPRESSED_MASKS:
        size = COMPRESSED_MASK_SIZE
        _COMPRESSED_MASKS[key] = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
    return _COMPRESSED_MASKS[key]


def npu_attention_mask(
    mask: torch.Tensor | None, causal: bool, b: int, n: int, sq: int, sk: int, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """(atten_mask, sparse_mode) for npu_fusion_attention from chipset's (mask, causal).

    chipset's bool mask is True = attend; torch_npu's atten_mask is True = masked out.
    Causal alone uses sparse_mode 3 (right-down causal) with the compressed mask; a
    mask with or without causal is merged into one full mask of shape SS, 11SS, B1SS
    or BNSS (the shapes torch_npu accepts) with sparse_mode 0.
    """
    if mask is None:
        if not causal:
            return None, SPARSE_DEFAULT
        return _compressed_causal_mask(device), SPARSE_RIGHT_DOWN_CAUSAL
    blocked = ~mask
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        blocked = blocked | ~allowed
    while blocked.dim() < 4:
        blocked = blocked.unsqueeze(0)
    heads = 1 if blocked.shape[1] == 1 else n
    batch = 1 if blocked.shape[0] == 1 and heads == 1 else b  # 1NSS is not accepted: use BNSS
    return blocked.expand(batch, heads, sq, sk).contiguous(), SPARSE_DEFAULT


# --- fused_adamw: torch's multi-tensor (foreach) AdamW, which torch_npu implements ----
@torch.no_grad()
def fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    # torch increments each step tensor before using it; chipset's ``step`` is 1-based.
    steps = [torch.tensor(float(step - 1)) for _ in params]
    _torch_adamw(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
        foreach=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=False,
    )


# --- availability predicates ------------------------------------------------------
def predicates(device) -> dict[str, Callable[..., bool]]:
    """Per-kernel predicates. ``device.device_type`` is read at call time."""

    def on(*ts) -> bool:
        return all(isinstance(t, torch.Tensor) and t.device.type == device.device_type for t in ts)

    def rms_norm_ok(x, weight, eps=1e-6) -> bool:
        if not on(x) or x.dtype not in FLOATS or x.dim() < 1 or x.numel() == 0:
            return False
        return weight is None or (on(weight) and weight.dtype == x.dtype and tuple(weight.shape) == (x.shape[-1],))

    def rotary_ok(x, cos, sin) -> bool:
        # BNSD input with r1/r2 of shape 11SD, B1SD or BNSD (or fewer leading dims);
        # D even and < 896, B and N < 1000 (documented limits of the fused operator).
        if not on(x, cos, sin) or x.dim() != 4 or x.dtype not in FLOATS:
            return False
        if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != sin.shape or cos.dim() > 4:
            return False
        b, n, s, d = x.shape
        if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
            return False
        r = (1,) * (4 - cos.dim()) + tuple(cos.shape)
        return r[2:] == (s, d) and (r[:2] in ((1, 1), (b, 1), (b, n)))

    def swiglu_ok(gate, up) -> bool:
        return on(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in FLOATS and 1 <= gate.dim() <= 8 and gate.numel() > 0

    def sdpa_ok(q, k, v, mask=None, causal=False, scale=None) -> bool:
        if not on(q, k, v) or not (q.dim() == k.dim() == v.dim() == 4):
            return False
        if q.dtype not in HALF_FLOATS or k.dtype != q.dtype or v.dtype != q.dtype or k.shape != v.shape:
            return False
        b, n, sq, d = q.shape
        if k.shape[0] != b or k.shape[3] != d or n % k.shape[1] or d > 512:
            return False
        sk = k.shape[2]
        if causal and sq > sk:
            return False  # leading rows would attend to nothing; the reference defines that (zeros)
        if mask is None:
            return True
        if not on(mask) or mask.dtype != torch.bool or mask.dim() > 4:
            return False  # additive float masks stay on the reference
        try:
            return tuple(torch.broadcast_shapes(tuple(mask.shape), (b, n, sq, sk))) == (b, n, sq, sk)
        except RuntimeError:
            return False

    def adamw_ok(params, grads, exp_avgs, exp_avg_sqs, step, **kw) -> bool:
        if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)) or not params:
            return False
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
            if not on(p, g, m, v) or not (p.dtype == g.dtype == m.dtype == v.dtype) or p.dtype not in FLOATS:
                return False
        return True

    preds = {
        "rms_norm": rms_norm_ok,
        "rotary_embedding": rotary_ok,
        "swiglu": swiglu_ok,
        "scaled_dot_product_attention": sdpa_ok,
        "fused_adamw": adamw_ok,
    }
    return {name: _no_on_bad_call(p) for name, p in preds.items()}


def _no_on_bad_call(pred: Callable[..., bool]) -> Callable[..., bool]:
    # ``registry.select(name)`` may ask without arguments: "not without arguments".
    def checked(*args, **kwargs) -> bool:
        try:
            return bool(pred(*args, **kwargs))
        except TypeError:
            return False

    return checked


# name -> (implementation, torch_npu operator it needs or None, description)
IMPLEMENTATIONS = {
    "rms_norm": (rms_norm, "npu_rms_norm", "torch_npu.npu_rms_norm"),
    "rotary_embedding": (rotary_embedding, "npu_rotary_mul", "torch_npu.npu_rotary_mul (half mode)"),
    "swiglu": (swiglu, "npu_swiglu", "torch_npu.npu_swiglu on cat(gate, up)"),
    "scaled_dot_product_attention": (scaled_dot_product_attention, "npu_fusion_attention", "torch_npu.npu_fusion_attention, BNSD"),
    "fused_adamw": (fused_adamw, None, "torch.optim.adamw foreach (multi-tensor) kernels on npu"),
}


def register(registry, device) -> None:
    """Register every fused kernel whose torch_npu operator exists in this torch_npu build."""
    preds = predicates(device)
    tnpu = torch_npu()
    for name, (fn, op, description) in IMPLEMENTATIONS.items():
        if op is not None and not hasattr(tnpu, op):
            continue  # an older torch_npu without this operator: the reference serves it
        registry.register(name, fn, priority=10, available=preds[name], description=description)
