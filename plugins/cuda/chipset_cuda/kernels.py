"""CUDA kernel implementations and the predicates that decide when each one is used.

- scaled_dot_product_attention: ``torch.nn.functional.scaled_dot_product_attention``,
  which picks flash / memory-efficient / cuDNN attention for the shape and dtype.
- fused_adamw: ``torch._fused_adamw_``, the multi-tensor kernel behind
  ``torch.optim.AdamW(fused=True)``.
- rms_norm, rotary_embedding, swiglu, cross_entropy: Triton kernels with a Triton
  backward (``chipset_cuda.triton_kernels``), registered only when triton is importable.
- fp8_matmul: ``torch._scaled_mm`` on FP8 tensor cores (``chipset_cuda.fp8``).
- grouped_mm: ``torch._grouped_mm``, every MoE expert's GEMM in one grouped kernel (bfloat16,
  where a tiny call on the GPU runs and gives the right answer: compute capability 8.0 and later,
  as this torch build covers), each expert's rows padded to a multiple of 8 (16 bytes), as
  torchtitan pads its token groups for the same kernel.

Every predicate takes the reference's arguments and returns False for anything it does
not handle exactly, so the registry falls back to the core reference. Tensors must live
on a CUDA device, except that under ``TRITON_INTERPRET=1`` the Triton kernels also
accept CPU tensors (Triton's interpreter runs them on the host; the tests use this).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections import defaultdict
from collections.abc import Sequence
from functools import cache

import torch
import torch.nn.functional as F

from chipset.kernels import grouped, reference
from chipset.kernels.asked import asked_once

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# --- scaled dot-product attention ------------------------------------------------------
def sdpa_available(q, k, v, mask=None, causal=False, scale=None) -> bool:
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v)):
        return False
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        return False
    if q.shape[1] % k.shape[1] != 0:
        return False
    # A float mask is added in the query dtype by torch; the reference adds it in fp32.
    return mask is None or mask.dtype == torch.bool or mask.dtype == q.dtype


def scaled_dot_product_attention(q, k, v, mask=None, causal=False, scale=None):
    """The reference's semantics on torch's SDPA (bottom-right causal, GQA, bool/float mask)."""
    sq, sk = q.shape[-2], k.shape[-2]
    gqa = k.shape[-3] != q.shape[-3]
    if mask is None:
        if not causal or sq == sk:
            # Square causal: torch's top-left alignment equals the reference's bottom-right.
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        from torch.nn.attention.bias import causal_lower_right  # keeps the flash path open

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale, enable_gqa=gqa)
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        mask = mask & allowed if mask.dtype == torch.bool else mask.masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # A query row with no key to attend: the reference gives zeros. torch's CUDA kernels gave
    # finite non-zero rows on an H200 (torch 2.11); the CPU kernel gives zeros.
    attends = mask.any(-1, keepdim=True) if mask.dtype == torch.bool else (mask > float("-inf")).any(-1, keepdim=True)
    return out.masked_fill(~attends, 0.0)


# --- grouped GEMM (MoE experts) ---------------------------------------------------------------
GROUPED_ALIGN_ROWS = 8  # bfloat16 rows: each expert's rows start 16 bytes apart along the weight gradient's K


def grouped_mm_available(x, w, offs) -> bool:
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(offs, torch.Tensor)):
        return False
    if not (x.is_cuda and w.is_cuda and offs.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    return x.dtype == torch.bfloat16 and grouped.accepts(x, w, offs) and device_runs_grouped_mm(x.device)


@asked_once
def device_runs_grouped_mm(dev: torch.device) -> bool:
    """Whether this torch build runs ``torch._grouped_mm`` in bfloat16 on ``dev``, forward and
    backward: on a GPU its kernel needs compute capability 8.0 or later, and torch releases differ
    in which they cover (the first ones only 9.0). Asked once per device, with gradients on, and
    untraced when the first MoE layer to ask is being compiled (:func:`chipset.kernels.asked.asked_once`)."""
    capable = dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 0)
    return capable and grouped_mm_runs(dev)


def grouped_mm_runs(dev: torch.device) -> bool:
    """A tiny padded bfloat16 call on ``dev``, forward and backward, gives the right answer."""
    try:
        x = torch.ones(16, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(2, 16, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = grouped.grouped_mm(x, w, torch.tensor([3, 16], device=dev, dtype=torch.int32), align_rows=GROUPED_ALIGN_ROWS)
        y.backward(torch.ones_like(y))
        rows = torch.tensor([3.0, 13.0], device=dev).view(2, 1, 1)  # each group's rows: its weights' gradient
        return bool(y.float().eq(16).all() and w.grad.float().eq(rows).all() and x.grad.float().eq(16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm(x, w, offs):
    return grouped.grouped_mm(x, w, offs, align_rows=GROUPED_ALIGN_ROWS)


# --- fused AdamW ---------------------------------------------------------------------------
def _fusable(p, g, m, v) -> bool:
    """torch's fused kernel (CUDA, and CPU since torch 2.4) wants one device and one float dtype."""
    if p.device.type not in ("cuda", "cpu") or p.dtype not in (*_FLOATS, torch.float64):
        return False
    return all(t.dtype == p.dtype and t.device == p.device and not t.is_sparse for t in (p, g, m, v))


def fused_adamw_available(params=None, grads=None, exp_avgs=None, exp_avg_sqs=None, step=None, **hyper) -> bool:
    # Called without arguments (``registry.select("fused_adamw")``) the answer is yes: the
    # implementation itself sends any tensor group the fused kernel cannot take to the reference.
    if params is None:
        return True
    return bool(params) and all(p.is_cuda for p in params)


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
    """One AdamW step in place, as the reference, through torch's fused multi-tensor kernel.

    Tensors are grouped by (device, dtype); a group the kernel cannot take (CPU tensors,
    bf16 parameters with fp32 moments, ...) is updated by the core reference instead.
    """
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    groups: dict[tuple, list[list[torch.Tensor]]] = defaultdict(lambda: [[], [], [], []])
    rest: list[list[torch.Tensor]] = [[], [], [], []]
    for quad in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        lists = groups[(quad[0].device, quad[0].dtype)] if _fusable(*quad) else rest
        for lst, t in zip(lists, quad, strict=True):
            lst.append(t)
    for (device, _), (ps, gs, ms, vs) in groups.items():
        # The kernel reads the (already incremented, 1-based) step from a float32 tensor.
        steps = [torch.tensor(float(step), dtype=torch.float32, device=device)] * len(ps)
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, **hyper)
    if rest[0]:
        reference.fused_adamw(*rest, step, **hyper)


# --- Triton kernels ----------------------------------------------------------------------
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def _triton_module():
    """chipset_cuda.triton_kernels, or None (with one warning) if triton fails to import."""
    try:
        from chipset_cuda import triton_kernels
    except Exception as exc:  # a broken triton install must not break training
        warnings.warn(f"chipset_cuda: Triton kernels disabled, importing triton failed: {exc!r}", stacklevel=2)
        return None
    return triton_kernels


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_tensor(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
        return False
    return t.is_cuda or (t.device.type == "cpu" and _interpreting())


def rms_norm_available(x, weight, eps=1e-6) -> bool:
    if not _triton_tensor(x) or x.dim() == 0 or x.numel() == 0:
        return False
    if weight is not None and (weight.dtype not in _FLOATS or weight.shape != x.shape[-1:] or weight.device != x.device):
        return False
    return x.shape[-1] <= 16384 and _triton_module() is not None


def rotary_embedding_available(x, cos, sin) -> bool:
    if not _triton_tensor(x) or x.dim() < 2 or x.numel() == 0 or x.shape[-1] % 2:
        return False
    s, d = x.shape[-2:]
    for t in (cos, sin):
        if not isinstance(t, torch.Tensor) or t.dtype != x.dtype or t.device != x.device or t.requires_grad:
            return False
        if t.dim() > x.dim() or tuple(t.shape[-2:]) != (s, d) or any(n != 1 for n in t.shape[:-2]):
            return False
    return d <= 2048 and _triton_module() is not None


def swiglu_available(gate, up) -> bool:
    if not (_triton_tensor(gate) and isinstance(up, torch.Tensor)):
        return False
    ok = up.dtype == gate.dtype and up.shape == gate.shape and up.device == gate.device and gate.numel() > 0
    return ok and _triton_module() is not None


def cross_entropy_available(logits, target, ignore_index=-100, reduction="mean") -> bool:
    if not _triton_tensor(logits) or logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return False
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        return False
    if target.shape != logits.shape[:1] or target.device != logits.device:
        return False
    return reduction in ("mean", "sum", "none") and _triton_module() is not None


def rms_norm(x, weight, eps=1e-6):
    return _triton_module().rms_norm(x, weight, eps)


def rotary_embedding(x, cos, sin):
    return _triton_module().rotary_embedding(x, cos, sin)


def swiglu(gate, up):
    return _triton_module().swiglu(gate, up)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    return _triton_module().cross_entropy(logits, target, ignore_index, reduction)


TRITON_KERNELS = {
    "rms_norm": (rms_norm, rms_norm_available),
    "rotary_embedding": (rotary_embedding, rotary_embedding_available),
    "swiglu": (swiglu, swiglu_available),
    "cross_entropy": (cross_entropy, cross_entropy_available),
}


def register(registry, hip: bool = False) -> None:
    """Register every CUDA kernel on ``registry``; Triton ones only when triton is installed and
    the build is not ROCm (``hip``): their block sizes and warp counts were chosen and measured
    for NVIDIA's 32-wide warps and were never run on AMD's 64-wide wavefronts, so on ROCm the
    core references run instead. torch's SDPA and fused AdamW have ROCm kernels and stay."""
    registry.register("scaled_dot_product_attention", scaled_dot_product_attention, priority=10,
                      available=sdpa_available, description="torch SDPA (flash / memory-efficient / cuDNN)")
    registry.register("fused_adamw", fused_adamw, priority=10, available=fused_adamw_available,
                      description="torch._fused_adamw_ (fused multi-tensor AdamW)")
    if not hip:  # NVIDIA only: grouped GEMM's kernel is CUTLASS-built, and Capabilities.fp8 is declared
        # for NVIDIA GPUs of compute capability >= 8.9 only
        registry.register("grouped_mm", grouped_mm, priority=10, available=grouped_mm_available,
                          description="torch._grouped_mm (every MoE expert in one grouped GEMM, bfloat16)")
        from chipset_cuda.fp8 import fp8_matmul, fp8_matmul_available

        registry.register("fp8_matmul", fp8_matmul, priority=10, available=fp8_matmul_available,
                          description="torch._scaled_mm (FP8 tensor cores)")
    if hip or not triton_importable():
        return
    for name, (fn, available) in TRITON_KERNELS.items():
        registry.register(name, fn, priority=10, available=available, description="Triton (forward and backward)")
