"""Ascend kernels: argument plumbing into torch_npu's fused operators, checked by the TEST DOUBLE.

The double checks each call against the operator's documented contract and computes
its math on CPU, so a kernel that passes the wrong layout, mask polarity, scale or
sparse_mode either raises or disagrees with chipset's reference here.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from chipset.kernels import reference as ref

_spec = importlib.util.spec_from_file_location("torch_npu_double_install", Path(__file__).parents[1] / "doubles" / "torch_npu_double" / "install.py")
double = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(double)


@pytest.fixture
def npu_double(monkeypatch, tmp_path):
    yield double.install(monkeypatch, tmp_path)
    double.purge_modules()


@pytest.fixture
def backend(npu_double):
    from chipset.discovery.records import discover
    from chipset.discovery.select import select
    from chipset.loader import load_backend

    records = discover(refresh=True)
    b = load_backend(select("ascend", records), records)
    b.device.device_type = "cpu"  # the double keeps "NPU" tensors on the host
    return b


@pytest.fixture
def calls(npu_double, monkeypatch):
    """Record every call into the double's fused operators (and still run them)."""
    log: list[tuple[str, tuple, dict]] = []
    for name in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"):
        real = getattr(npu_double, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            log.append((_name, args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(npu_double, name, spy)
    return log


def uses_npu(backend, name, *args, **kwargs) -> bool:
    return backend.kernels.select(name, *args, **kwargs) is not backend.kernels.reference(name)


g = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# --- rms_norm, rotary, swiglu ------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_runs_npu_rms_norm_and_matches_the_reference(backend, calls, dtype, tol, with_weight):
    x = rand(2, 5, 16, dtype=dtype)
    w = rand(16, dtype=dtype) if with_weight else None
    out = backend.kernels.rms_norm(x, w, eps=1e-5)
    assert [c[0] for c in calls] == ["npu_rms_norm"] and calls[0][2]["epsilon"] == 1e-5
    torch.testing.assert_close(out, ref.rms_norm(x, w, eps=1e-5), rtol=tol, atol=tol)


@pytest.mark.parametrize("cos_shape", [(7, 8), (1, 1, 7, 8), (2, 1, 7, 8), (2, 3, 7, 8)])
def test_rotary_runs_npu_rotary_mul_with_4d_tables(backend, calls, cos_shape):
    x = rand(2, 3, 7, 8)
    cos, sin = rand(*cos_shape), rand(*cos_shape)
    out = backend.kernels.rotary_embedding(x, cos, sin)
    assert calls[0][0] == "npu_rotary_mul" and all(t.dim() == 4 for t in calls[0][1])
    torch.testing.assert_close(out, ref.rotary_embedding(x, cos, sin))


def test_rotary_outside_the_operator_contract_uses_the_reference(backend):
    x = rand(2, 7, 3, 8)  # a BSND tensor with (S, 1, D) tables: not the reference's (..., seq, dim) layout
    cos = rand(7, 1, 8)
    assert not uses_npu(backend, "rotary_embedding", x, cos, cos)
    assert not uses_npu(backend, "rotary_embedding", rand(2, 3, 7, 8), rand(7, 8, dtype=torch.float16), rand(7, 8))  # mixed dtypes
    assert not uses_npu(backend, "rotary_embedding", rand(2, 3, 7, 896), rand(7, 896), rand(7, 896))  # D >= 896


def test_swiglu_gates_the_first_half(backend, calls):
    gate, up = rand(4, 6), rand(4, 6)
    out = backend.kernels.swiglu(gate, up)
    (name, args, kwargs), = calls
    assert name == "npu_swiglu" and args[0].shape == (4, 12) and kwargs["dim"] == -1
    torch.testing.assert_close(out, ref.swiglu(gate, up))


# --- scaled_dot_product_attention --------------------------------------------------------
CASES = {
    "plain": dict(sq=5, sk=5),
    "causal": dict(sq=6, sk=6, causal=True),
    "causal, fewer queries (bottom-right)": dict(sq=3, sk=7, causal=True),
    "padding mask": dict(sq=5, sk=6, mask="padding"),
    "full mask + causal": dict(sq=5, sk=5, mask="full", causal=True),
    "grouped-query": dict(sq=4, sk=4, kv_heads=2, causal=True),
    "explicit scale": dict(sq=4, sk=4, scale=0.3),
}


def make_attention(sq, sk, causal=False, mask=None, kv_heads=4, scale=None, dtype=torch.float16):
    b, n, d = 2, 4, 16
    q, k, v = rand(b, n, sq, d, dtype=dtype), rand(b, kv_heads, sk, d, dtype=dtype), rand(b, kv_heads, sk, d, dtype=dtype)
    m = None
    if mask == "padding":  # (b, 1, 1, sk): batch 1 ignores its last two keys
        m = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        m[1, ..., -2:] = False
    elif mask == "full":
        m = torch.rand(b, n, sq, sk, generator=g) > 0.3
        m[..., 0] = True  # every row keeps at least one key
    return (q, k, v), dict(mask=m, causal=causal, scale=scale)


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_runs_npu_fusion_attention_and_matches_the_reference(backend, calls, case):
    args, kw = make_attention(**CASES[case])
    out = backend.kernels.scaled_dot_product_attention(*args, **kw)
    torch.testing.assert_close(out, ref.scaled_dot_product_attention(*args, **kw), rtol=1e-3, atol=1e-3)
    (name, pos, call), = calls
    q = args[0]
    assert name == "npu_fusion_attention"
    assert pos[3] == q.shape[1] and pos[4] == "BNSD"  # head_num, input_layout
    assert pos[1].shape[1] == q.shape[1]  # K/V heads repeated for grouped-query attention
    expected_scale = kw["scale"] if kw["scale"] is not None else 1 / math.sqrt(q.shape[-1])
    assert call["scale"] == pytest.approx(expected_scale) and call["keep_prob"] == 1.0


def test_causal_alone_uses_the_compressed_mask_and_right_down_causal(backend, calls):
    args, kw = make_attention(sq=3, sk=7, causal=True)
    backend.kernels.scaled_dot_product_attention(*args, **kw)
    call = calls[0][2]
    assert call["sparse_mode"] == 3
    assert call["atten_mask"].shape == (2048, 2048) and call["atten_mask"].dtype == torch.bool
    assert call["atten_mask"][0, 1] and not call["atten_mask"][1, 0]  # True above the diagonal = masked out


def test_a_mask_is_inverted_because_torch_npu_masks_where_true(backend, calls):
    args, kw = make_attention(sq=5, sk=6, mask="padding")
    backend.kernels.scaled_dot_product_attention(*args, **kw)
    call = calls[0][2]
    assert call["sparse_mode"] == 0 and call["atten_mask"].shape == (2, 1, 5, 6)
    assert torch.equal(call["atten_mask"], (~kw["mask"]).expand(2, 1, 5, 6))


def test_the_double_catches_wrong_plumbing(npu_double):
    (q, k, v), kw = make_attention(sq=3, sk=7, causal=True)
    want = ref.scaled_dot_product_attention(q, k, v, causal=True)
    compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    # Left-up causal (sparse_mode 2) is a different mask when Sq != Skv: wrong numbers.
    wrong = npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed, scale=0.25, sparse_mode=2)[0]
    assert not torch.allclose(wrong, want, atol=1e-2)
    right = npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed, scale=0.25, sparse_mode=3)[0]
    torch.testing.assert_close(right, want, rtol=1e-3, atol=1e-3)
    # A chipset mask (True = attend) passed through without inverting: wrong numbers.
    (q, k, v), kw = make_attention(sq=5, sk=6, mask="padding")
    m = kw["mask"].expand(2, 1, 5, 6).contiguous()
    uninverted = npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=m, scale=0.25)[0]
    assert not torch.allclose(uninverted, ref.scaled_dot_product_attention(q, k, v, mask=kw["mask"]), atol=1e-2)
    # Contract violations raise.
    with pytest.raises(RuntimeError, match="head_num"):
        npu_double.npu_fusion_attention(q, k, v, 8, "BNSD", scale=0.25)
    with pytest.raises(RuntimeError, match="compressed"):
        npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.ones(5, 6, dtype=torch.bool).triu(1), scale=0.25, sparse_mode=3)
    with pytest.raises(RuntimeError, match="not SS, 11SS, B1SS or BNSS"):
        npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~kw["mask"], scale=0.25)
    with pytest.raises(RuntimeError, match="scale must be a float"):
        npu_double.npu_fusion_attention(q, k, v, 4, "BNSD", scale=1)


@pytest.mark.parametrize(
    "why, make",
    [
        ("additive float mask", lambda: (make_attention(4, 4)[0], dict(mask=torch.zeros(4, 4)))),
        ("float32 inputs", lambda: make_attention(4, 4, dtype=torch.float32)),
        ("causal with more queries than keys", lambda: make_attention(6, 3, causal=True)),
    ],
)
def test_sdpa_outside_the_contract_uses_the_reference(backend, why, make):
    args, kw = make()
    assert not uses_npu(backend, "scaled_dot_product_attention", *args, **kw), why


def test_tensors_on_another_device_type_use_the_reference(backend):
    backend.device.device_type = "npu"  # as on hardware: these CPU tensors are not NPU tensors
    x = rand(2, 8)
    assert not uses_npu(backend, "rms_norm", x, None)
    assert not uses_npu(backend, "swiglu", x, x)


# --- fused_adamw -------------------------------------------------------------------------
def test_fused_adamw_matches_the_reference_over_steps(backend):
    shapes = [(4, 3), (7,)]
    params = [rand(*s) for s in shapes]
    state = [[torch.zeros(*s) for s in shapes] for _ in range(2)]
    mine = [p.clone() for p in params], [t.clone() for t in state[0]], [t.clone() for t in state[1]]
    theirs = [p.clone() for p in params], [t.clone() for t in state[0]], [t.clone() for t in state[1]]
    assert uses_npu(backend, "fused_adamw", mine[0], mine[0], mine[1], mine[2], 1, lr=1e-2)
    for step in (1, 2, 3):
        grads = [rand(*s) for s in shapes]
        hp = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
        backend.kernels.fused_adamw(mine[0], grads, mine[1], mine[2], step, **hp)
        ref.fused_adamw(theirs[0], grads, theirs[1], theirs[2], step, **hp)
    for a, b in zip(mine[0] + mine[1] + mine[2], theirs[0] + theirs[1] + theirs[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adamw_with_mixed_dtypes_uses_the_reference(backend):
    p, m = [rand(3, dtype=torch.bfloat16)], [torch.zeros(3)]
    assert not uses_npu(backend, "fused_adamw", p, p, m, m, 1, lr=1e-3)
