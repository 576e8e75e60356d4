"""chipset-cuda's torch-backed kernels (SDPA, fused AdamW) against the core references.

Both wrappers call torch ops that also run on CPU (SDPA's math backend, the CPU fused
AdamW), so their argument translation is checked here; the CUDA kernels behind them
are checked by plugins/cuda/gpu_check.py on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from chipset.kernels import reference
from chipset_cuda import backend, kernels

TOL = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def _close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sq", "sk", "kv_heads", "causal", "mask"),
    [
        (5, 5, 4, False, None),
        (5, 5, 4, True, None),
        (3, 7, 4, True, None),  # bottom-right causal, not torch's top-left
        (5, 5, 2, False, None),  # grouped-query attention
        (4, 6, 2, True, "bool"),
        (4, 6, 4, False, "float"),
        (4, 6, 4, False, "row-masked"),  # a query that may attend nothing gives zeros
    ],
)
def test_sdpa_wrapper_matches_the_reference(dtype, sq, sk, kv_heads, causal, mask):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, sq, 8, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, sk, 8, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, sk, 8, generator=g).to(dtype)
    m = None
    if mask in ("bool", "row-masked"):
        m = torch.rand(sq, sk, generator=g) > 0.3
        m[:, -1] = True
        if mask == "row-masked":
            m[1] = False
    elif mask == "float":
        m = torch.randn(sq, sk, generator=g).to(dtype)
    got = kernels.scaled_dot_product_attention(q, k, v, mask=m, causal=causal)
    want = reference.scaled_dot_product_attention(q, k, v, mask=m, causal=causal)
    if dtype == torch.bfloat16:
        # The reference accumulates in fp32 and rounds once; torch's bf16 SDPA rounds the
        # probabilities to bf16 before P@V: the backend declares this looser tolerance.
        rtol, atol = backend.KERNEL_TOLERANCES["scaled_dot_product_attention/bfloat16"]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    else:
        _close(got, want, dtype)
    if mask == "row-masked":
        assert torch.all(got[:, :, 1] == 0)


def test_sdpa_predicate_wants_cuda_tensors_of_one_float_dtype():
    q = torch.randn(1, 2, 4, 8)
    assert not kernels.sdpa_available(q, q, q)  # CPU
    assert not kernels.sdpa_available(q.double(), q.double(), q.double())


def _adam_state(dtype, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 5), (7,), (2, 3, 2)][:n]
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    m = [torch.randn(s, generator=g).to(dtype) * 0.1 for s in shapes]
    v = [torch.rand(s, generator=g).to(dtype) * 0.01 for s in shapes]
    return params, grads, m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [1, 7])
def test_fused_adamw_matches_the_reference(dtype, step):
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours = _adam_state(dtype)
    ref = [[t.clone() for t in lst] for lst in ours]
    kernels.fused_adamw(*ours, step, **hyper)
    reference.fused_adamw(*ref, step, **hyper)
    for got, want in zip(ours[0] + ours[2] + ours[3], ref[0] + ref[2] + ref[3], strict=True):
        if dtype == torch.bfloat16:
            # The reference rounds after every in-place op (m*beta1, then +(1-beta1)g, which can
            # cancel); the fused kernel rounds once from fp32. Allow one bf16 ulp (2**-8) at the
            # tensor's scale.
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
        else:
            _close(got, want, dtype)
    assert not torch.equal(ours[0][0], _adam_state(dtype)[0][0])  # it did update in place


def test_fused_adamw_sends_groups_the_kernel_cannot_take_to_the_reference(monkeypatch):
    # bf16 parameters with fp32 moments (mixed precision) are not one-dtype groups.
    p, g, _, _ = _adam_state(torch.bfloat16, n=2)
    m = [torch.zeros(t.shape) for t in p]
    v = [torch.zeros(t.shape) for t in p]
    fused_calls = []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused_calls.append(a))
    ref = [[t.clone() for t in lst] for lst in (p, g, m, v)]
    kernels.fused_adamw(p, g, m, v, 1, lr=1e-2)
    reference.fused_adamw(*ref, 1, lr=1e-2)
    assert fused_calls == []
    for got, want in zip(p + m + v, ref[0] + ref[2] + ref[3], strict=True):
        assert torch.equal(got, want)


def test_fused_adamw_predicate_wants_cuda_tensors_but_accepts_a_bare_select():
    p, g, m, v = _adam_state(torch.float32)
    assert not kernels.fused_adamw_available(p, g, m, v, 1, lr=1e-3)  # CPU tensors
    assert not kernels.fused_adamw_available([], [], [], [], 1, lr=1e-3)
    assert kernels.fused_adamw_available()  # registry.select("fused_adamw") with no arguments
