"""torch's own CPU kernels behind chipset's kernel names, each with the reference's semantics.

- scaled_dot_product_attention: ``F.scaled_dot_product_attention`` (a fused CPU kernel:
  no materialised causal mask, no separate softmax and NaN-cleaning passes). Used when no
  row can be fully masked (no explicit mask; causal only with as many queries as keys),
  since the reference defines such rows as zeros; everything else goes to the reference.
- attention_block / attention_block_backward: torch's flash attention for CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), which tiles the
  keys and returns the log-sum-exp the ring merges with; float32, no mask.
- fused_adamw: ``torch._fused_adamw_``, the CPU multi-tensor kernel behind
  ``torch.optim.AdamW(fused=True)``; groups it cannot take go to the reference.
- rms_norm (float32), swiglu, cross_entropy: the ``torch.nn.functional`` ops, one C++
  call (and autograd node) each instead of the reference's chain of Python-level ops.
- grouped_mm: ``torch._grouped_mm``, every MoE expert's GEMM in one call (and one autograd
  node) instead of the reference's matmul per expert.
- grouped_mlp (float32): one autograd node running each MoE expert's gate and up GEMMs,
  SwiGLU and down GEMM on its rows back to back, in cache (chipset_cpu.grouped_mlp).

Every predicate takes the reference's arguments and says no to anything it does not
handle exactly, so the registry falls back to ``chipset.kernels.reference``. Attention,
RMSNorm and SwiGLU take float32 only: in bfloat16/float16 torch's kernels round at other
points than the reference (which upcasts attention to float32 and rounds SwiGLU's
product in the input dtype), beyond the conformance tolerances for those dtypes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from chipset.kernels import grouped, reference
from chipset.kernels.asked import asked_once
from chipset_cpu.grouped_mlp import grouped_mlp, grouped_mlp_available

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _cpu(*ts) -> bool:
    # On every kernel call (the predicates): a loop and ``is_cpu`` cost a fifth of a generator
    # over ``t.device.type``, which builds a device object per tensor.
    for t in ts:
        if not (isinstance(t, torch.Tensor) and t.is_cpu):
            return False
    return True


def sdpa_available(q, k, v, mask=None, causal=False, scale=None) -> bool:
    if not _cpu(q, k, v) or q.dtype != torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[-1] != k.shape[-1]:
        return False
    if q.shape[1] % k.shape[1] or q.shape[0] != k.shape[0]:
        return False
    return mask is None and (not causal or q.shape[-2] == k.shape[-2])


def scaled_dot_product_attention(q, k, v, mask=None, causal=False, scale=None):
    # Square causal: torch's top-left alignment is the reference's bottom-right one.
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def block_available(q, k, v, mask=None, causal=False, scale=None, docs=None) -> bool:
    if not sdpa_available(q, k, v) or mask is not None or docs is not None:
        return False
    return k.shape[1] == q.shape[1] and (not causal or q.shape[-2] == k.shape[-2])


def attention_block(q, k, v, mask=None, causal=False, scale=None, docs=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def block_backward_available(do, q, k, v, out, lse, mask=None, causal=False, scale=None, docs=None) -> bool:
    return block_available(q, k, v, mask, causal, docs=docs) and _cpu(do, out, lse) and do.dtype == out.dtype == q.dtype


def attention_block_backward(do, q, k, v, out, lse, mask=None, causal=False, scale=None, docs=None):
    # The kernel reads out and lse as given: the merged ones make this block's share exact.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)


def fused_adamw_available(params=None, grads=None, exp_avgs=None, exp_avg_sqs=None, step=None, **hyper) -> bool:
    # Without arguments (``registry.select("fused_adamw")``): yes; the implementation itself
    # sends any group the fused kernel cannot take to the reference.
    return params is None or (bool(params) and _cpu(*params))


def _fusable(p, g, m, v) -> bool:
    if p.dtype not in (*_FLOATS, torch.float64) or not _cpu(p, g, m, v):
        return False
    return all(t.dtype == p.dtype and not t.is_sparse for t in (g, m, v))


@torch.no_grad()
def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0) -> None:
    """One AdamW step in place (the reference's), through torch's fused CPU kernel."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    groups: dict[torch.dtype, list[list[torch.Tensor]]] = defaultdict(lambda: [[], [], [], []])
    rest: list[list[torch.Tensor]] = [[], [], [], []]
    for quad in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        lists = groups[quad[0].dtype] if _fusable(*quad) else rest
        for lst, t in zip(lists, quad, strict=True):
            lst.append(t)
    for ps, gs, ms, vs in groups.values():
        # The kernel reads the (already incremented, 1-based) step from float32 tensors.
        steps = [torch.tensor(float(step))] * len(ps)
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, **hyper)
    if rest[0]:
        reference.fused_adamw(*rest, step, **hyper)


def rms_norm_available(x, weight, eps=1e-6) -> bool:
    if not _cpu(x) or x.dtype != torch.float32:
        return False
    return weight is None or (_cpu(weight) and weight.dtype == torch.float32 and weight.shape == x.shape[-1:])


def rms_norm(x, weight, eps=1e-6):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def swiglu_available(gate, up) -> bool:
    return _cpu(gate, up) and gate.dtype == torch.float32 and up.dtype == gate.dtype and up.shape == gate.shape


def swiglu(gate, up):
    return F.silu(gate) * up


def cross_entropy_available(logits, target, ignore_index=-100, reduction="mean") -> bool:
    if not _cpu(logits, target) or logits.dim() != 2 or target.shape != logits.shape[:1]:
        return False
    return target.dtype == torch.int64 and reduction in ("mean", "sum", "none")


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    lf = logits.float()
    if reduction != "mean":
        return F.cross_entropy(lf, target, ignore_index=ignore_index, reduction=reduction)
    # The reference's mean over no valid target is 0, not NaN.
    count = (target != ignore_index).sum().clamp(min=1)
    return F.cross_entropy(lf, target, ignore_index=ignore_index, reduction="sum") / count


@asked_once
def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on the CPU, forward and backward (torch 2.8 has
    the op for CUDA only; a later release added the CPU kernel)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 4, requires_grad=True)
        y = torch._grouped_mm(x, torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
        y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_available(x, w, offs) -> bool:
    return _cpu(x, w, offs) and _cpu_grouped_mm() and x.dtype in _FLOATS and grouped.accepts(x, w, offs)


def grouped_mm(x, w, offs):
    return grouped.grouped_mm(x, w, offs)


KERNELS = {
    "scaled_dot_product_attention": (scaled_dot_product_attention, sdpa_available, "torch SDPA (fused CPU attention)"),
    "attention_block": (attention_block, block_available, "torch flash attention for CPU, with log-sum-exp"),
    "attention_block_backward": (attention_block_backward, block_backward_available,
                                 "torch flash attention backward for CPU"),
    "fused_adamw": (fused_adamw, fused_adamw_available, "torch._fused_adamw_ (fused multi-tensor AdamW, CPU)"),
    "rms_norm": (rms_norm, rms_norm_available, "torch.nn.functional.rms_norm (float32)"),
    "swiglu": (swiglu, swiglu_available, "torch.nn.functional.silu times up"),
    "cross_entropy": (cross_entropy, cross_entropy_available, "torch.nn.functional.cross_entropy"),
    "grouped_mm": (grouped_mm, grouped_mm_available, "torch._grouped_mm (all MoE experts in one call)"),
    "grouped_mlp": (grouped_mlp, grouped_mlp_available, "each MoE expert's SwiGLU MLP on its rows at once, float32"),
}


def register(registry) -> None:
    for name, (fn, available, description) in KERNELS.items():
        registry.register(name, fn, priority=10, available=available, description=description)
