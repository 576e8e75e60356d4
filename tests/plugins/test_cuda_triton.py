"""chipset-cuda's Triton kernels on this CPU, through Triton's interpreter, against the core references.

``TRITON_INTERPRET=1`` must be set when triton is first imported (its library functions,
e.g. ``tl.sigmoid``, are ``@triton.jit`` too) and when the kernel module is imported, so
this module sets it before importing either, removes it again afterwards, and sets it
again around each of its tests (triton reads it lazily as well), so other tests'
environment is left alone. Shapes are tiny: the interpreter runs every program in Python.

Tolerances are docs/formulas.md's per dtype (fp32 1.3e-6/1e-5, fp16 1e-3/1e-5, bf16 1.6e-2/1e-5)
with one declared exception, documented in docs/cuda.md: swiglu's gate gradient in
fp16 is the sum of two rounded terms that can cancel; eager CPU rounds
``sigmoid_backward`` after each fp16 op where CUDA (and the kernel) round once, so it is
compared at one fp16 ulp (2**-10) of the gradient's scale.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

from chipset.kernels import KernelRegistry, reference
from chipset_cuda import kernels


def _import_triton_interpreted():
    """(triton.language, triton.runtime.interpreter, chipset_cuda.triton_kernels), all interpreted."""
    if "triton" in sys.modules:
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(std.sigmoid, InterpretedFunction):
            pytest.skip(
                "triton was imported before this module could enable its interpreter; run "
                "`pytest tests/plugins/test_cuda_triton.py` on its own to test the Triton kernels",
                allow_module_level=True,
            )
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        import triton.language as tl
        from triton.runtime import interpreter

        from chipset_cuda import triton_kernels

        if not isinstance(triton_kernels._swiglu_fwd, interpreter.InterpretedFunction):
            triton_kernels = importlib.reload(triton_kernels)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return triton, tl, interpreter, triton_kernels


triton, tl, interpreter, tk = _import_triton_interpreted()

TOL = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
DTYPES = list(TOL)


@pytest.fixture(autouse=True)
def interpreting(monkeypatch):
    """Triton consults TRITON_INTERPRET lazily too (e.g. at first launch), so keep it set."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def interpreter_rounds_bf16_like_a_gpu(monkeypatch, request):
    """Triton 3.x's interpreter truncates fp32->bf16 casts; GPUs round to nearest even.

    Without this the interpreter, not the kernel, would be tested in bf16. The patch
    converts with torch (round-to-nearest-even), exactly what ``cvt.rn.bf16.f32`` does.
    """
    original = getattr(interpreter.InterpreterBuilder, "cast_impl", None)
    if original is None:
        if getattr(getattr(request.node, "callspec", None), "params", {}).get("dtype") == torch.bfloat16:
            pytest.skip(f"triton {triton.__version__}'s interpreter has no InterpreterBuilder.cast_impl to fix "
                        "bf16 rounding in; update this fixture (tested with triton 3.9.0)")
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bf = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(bf.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _close(actual, expected, dtype, atol=None):
    rtol, default_atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=default_atol if atol is None else atol)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _check(ref_fn, tri_fn, inputs, args, dtype, out_dtype=None, grad_atol=None):
    """Forward and every input gradient of ``tri_fn`` against ``ref_fn``."""
    a, b = _leaves(*inputs), _leaves(*inputs)
    want, got = ref_fn(*a, *args), tri_fn(*b, *args)
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want, out_dtype or dtype)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(want.dtype)
    want.backward(dy)
    got.backward(dy)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        atol = grad_atol(x.grad) if grad_atol else None
        _close(y.grad, x.grad, dtype, atol=atol)
        assert y.grad.abs().sum() > 0, f"gradient {i} is all zeros"


def _randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_forward_and_backward(dtype):
    # 15 rows over 4 programs exercises the backward's row loop and partial weight grads;
    # 40 columns in a 64-wide block exercises the masks.
    x = _randn(3, 5, 40, dtype=dtype)
    w = _randn(40, dtype=dtype, seed=1)
    _check(reference.rms_norm, tk.rms_norm, [x, w], [1e-6], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_with_a_float32_weight_promotes_like_the_reference(dtype):
    # Autocast keeps parameters in fp32 while activations are bf16/fp16: output is fp32.
    x = _randn(3, 5, 40, dtype=dtype)
    w = _randn(40, dtype=torch.float32, seed=1)
    assert tk.rms_norm(x, w).dtype == torch.float32
    _check(reference.rms_norm, tk.rms_norm, [x, w], [1e-6], dtype, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight(dtype):
    _check(lambda x: reference.rms_norm(x, None, 1e-5), lambda x: tk.rms_norm(x, None, 1e-5),
           [_randn(6, 24, dtype=dtype)], [], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_shape", [(7, 12), (1, 1, 7, 12)])
def test_rotary_embedding_forward_and_backward(dtype, cos_shape):
    x = _randn(2, 3, 7, 12, dtype=dtype)
    cos = _randn(*cos_shape, dtype=dtype, seed=1)
    sin = _randn(*cos_shape, dtype=dtype, seed=2)
    _check(reference.rotary_embedding, tk.rotary_embedding, [x], [cos, sin], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_forward_and_backward(dtype):
    gate = _randn(4, 33, dtype=dtype, scale=3.0)
    up = _randn(4, 33, dtype=dtype, seed=1)
    grad_atol = (lambda g: 2**-10 * g.abs().max().item()) if dtype == torch.float16 else None
    _check(reference.swiglu, tk.swiglu, [gate, up], [], dtype, grad_atol=grad_atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("block", [16, 4096])
def test_cross_entropy_forward_and_backward(dtype, reduction, block, monkeypatch):
    # block=16 streams the 37-wide vocabulary in three chunks (online logsumexp).
    monkeypatch.setattr(tk, "CE_BLOCK", block)
    logits = _randn(6, 37, dtype=dtype, scale=2.0)
    target = torch.randint(0, 37, (6,), generator=torch.Generator().manual_seed(3))
    target[2] = -100
    # The loss is float32 in both (the reference computes in fp32); gradients are in dtype.
    _check(reference.cross_entropy, tk.cross_entropy, [logits], [target, -100, reduction], dtype,
           out_dtype=torch.float32)


def test_cross_entropy_out_of_range_target_is_nan_not_a_wild_read():
    loss = tk.cross_entropy(torch.randn(2, 5), torch.tensor([1, 9]), reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1])


def test_registry_dispatches_to_triton_when_the_predicate_holds(monkeypatch):
    # TRITON_INTERPRET=1 (the fixture) is what lets the predicates accept CPU tensors.
    reg = KernelRegistry("cuda")
    kernels.register(reg)
    x, w = _randn(4, 16, dtype=torch.float32), _randn(16, dtype=torch.float32, seed=1)
    assert reg.select("rms_norm", x, w) is kernels.rms_norm
    _close(reg.rms_norm(x, w), reference.rms_norm(x, w), torch.float32)
    # Unsupported arguments fall back to the reference.
    assert reg.select("rms_norm", x, w.double()) is reg.reference("rms_norm")
    assert reg.select("rms_norm", x.bfloat16(), w) is kernels.rms_norm  # autocast: fp32 weight
    assert reg.select("rms_norm", _randn(2, 20000, dtype=torch.float32), None) is reg.reference("rms_norm")
    assert reg.select("rotary_embedding", _randn(2, 4, 7, dtype=torch.float32), x[:4, :7], x[:4, :7]) is reg.reference("rotary_embedding")
    assert reg.select("swiglu", x, x.double()) is reg.reference("swiglu")
    assert reg.select("cross_entropy", x, torch.zeros(4, dtype=torch.int64)) is kernels.cross_entropy
    assert reg.select("cross_entropy", x[None], torch.zeros(1, 4, dtype=torch.int64)) is reg.reference("cross_entropy")
