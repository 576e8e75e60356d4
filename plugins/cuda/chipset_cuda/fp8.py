"""FP8 GEMMs on tensor cores (compute capability >= 8.9): ``torch._scaled_mm`` behind the core's
``fp8_matmul`` (chipset/kernels/fp8.py).

The core specifies the numerics (the scales, the rounding to FP8) and runs the forward and
backward around a one-GEMM primitive; this module supplies that primitive on the GPU: the
operands are quantised exactly as the reference does (``quantize``), and only the product of the
FP8 operands runs on the tensor cores, summed in float32, dequantised by ``_scaled_mm``'s scales.
The conformance check ``test_fp8_matmul_matches_exact_emulation`` certifies it.

Where ``_scaled_mm`` cannot run a call the reference (an emulation, slow) runs instead: operand
dims not multiples of 16 (cuBLASLt's FP8 layout rule), rowwise scaling with an output other than
bfloat16 (the only one torch's rowwise kernel writes), or tensors not on a CUDA device.
"""

from __future__ import annotations

from functools import partial

import torch

from chipset.kernels.fp8 import fp8_matmul as _reference_matmul
from chipset.kernels.fp8 import quantize


def scaled_mm_gemm(a, b, scaling, fmt_a, fmt_b, out_dtype):
    """``a @ b`` (``[M, K] @ [K, N]``) through FP8 operands on the tensor cores."""
    qa, sa = quantize(a, fmt_a, scaling, dim=1)
    qb, sb = quantize(b, fmt_b, scaling, dim=0)
    qb = qb.t().contiguous().t()  # _scaled_mm takes its second operand column-major
    return torch._scaled_mm(qa.contiguous(), qb, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype)


fp8_matmul = partial(_reference_matmul, gemm=scaled_mm_gemm)


def fp8_matmul_available(x, w, scaling="tensorwise") -> bool:
    w = getattr(w, "param", w)  # an Fp8Weight (ZeRO-3's FP8 all-gather): its weight's dtype, shape, device
    if not (isinstance(x, torch.Tensor) and x.is_cuda and w.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if scaling == "rowwise" and x.dtype != torch.bfloat16:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return all(d % 16 == 0 for d in (x.shape[-1], w.shape[0], rows))
