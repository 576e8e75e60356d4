"""Kernels: what dispatch runs on the backend matches the core reference, forward and backward.

Each kernel is run through the backend's registry (its own implementation where it
registers one, else the reference) and compared with the core reference on the same
device and dtype, and with the exact answer: the reference in float64 on the CPU, from the
same (rounded) inputs. A kernel passes where every element is within the dtype's tolerance
of the exact answer, widened by the largest error the reference itself makes:

    |got - exact| <= atol + rtol * |exact| + max|reference - exact|

The eager reference rounds every intermediate to the dtype; where rounded terms cancel
(rotary's x1*cos - x2*sin, swiglu's gate gradient) its error is far above the dtype's
tolerance of the result, and a correct kernel that rounds differently makes errors of the
same size at other elements, so comparing the two directly fails it
(chipset.conformance.assert_close_to_exact). Tolerances: docs/formulas.md's table
(chipset.conformance.TOLERANCES), or the backend's documented override in
``Capabilities.tolerances`` keyed ``"kernel/dtype"`` or ``"dtype"``.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import pytest
import torch

from chipset.conformance import assert_close_to_exact, exact, tolerance
from chipset.kernels import REFERENCE_KERNELS

if TYPE_CHECKING:
    from chipset.loader import Backend

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _inputs(name: str, dt: torch.dtype, dev) -> tuple[list, dict, list[int]]:
    """(args, kwargs, indices of args that need gradients)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable across processes

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(dev)

    if name == "rms_norm":
        return [r(4, 64), r(64)], {}, [0, 1]
    if name == "layer_norm":
        return [r(4, 64), r(64), r(64)], {}, [0, 1, 2]
    if name == "rotary_embedding":
        ang = torch.randn(8, 16, generator=g)
        return [r(2, 4, 8, 16), ang.cos().to(dt).to(dev), ang.sin().to(dt).to(dev)], {}, [0]
    if name == "swiglu":
        return [r(4, 64), r(4, 64)], {}, [0, 1]
    if name == "scaled_dot_product_attention":
        return [r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16)], {"causal": True}, [0, 1, 2]
    if name == "cross_entropy":
        target = torch.randint(0, 32, (8,), generator=g).to(dev)
        return [r(8, 32), target], {}, [0]
    if name == "grouped_mm":  # 3 groups of 4, 0 and 7 rows; the weights as MoE experts pass them (a transposed view)
        return [r(11, 16), r(3, 8, 16).transpose(1, 2), torch.tensor([4, 4, 11], dtype=torch.int32).to(dev)], {}, [0, 1]
    if name == "grouped_mlp":  # the same groups; gate and up 16 -> 8, down 8 -> 16, as MoE passes them
        ws = [r(3, 8, 16, scale=0.25).transpose(1, 2), r(3, 8, 16, scale=0.25).transpose(1, 2),
              r(3, 16, 8, scale=0.25).transpose(1, 2)]
        return [r(11, 16), *ws, torch.tensor([4, 4, 11], dtype=torch.int32).to(dev)], {}, [0, 1, 2, 3]
    raise KeyError(name)


BLOCKWISE = ("attention_block", "attention_block_backward")  # tuples out, no autograd: own test below
OWN_MODULE = ("fused_adamw", "fp8_matmul", "linear")  # own tests below (fp8_matmul only where declared)
DIFFERENTIABLE = [k for k in REFERENCE_KERNELS if k not in OWN_MODULE and k not in BLOCKWISE]


def _require(caps, dtype):
    if dtype not in caps.dtypes:
        pytest.skip(f"backend does not declare dtype {dtype}")


def _call(fn, args, kwargs, need, grad: bool, dt):
    if grad:
        args = [a.detach().requires_grad_(True) if i in need else a for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    if not grad:
        return [out.detach()]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dt).to(out.dtype).to(out.device)
    out.backward(upstream)
    return [args[i].grad for i in need]


def _run(fn, name, dt, dev, grad: bool, in_exact: bool = False):
    """Outputs (or input gradients) of ``fn`` on the suite's inputs; ``in_exact``: in float64 on
    the CPU from the same dtype-rounded inputs and upstream gradient."""
    args, kwargs, need = _inputs(name, dt, dev)
    if in_exact:
        args, kwargs = [exact(a) for a in args], {k: exact(v) for k, v in kwargs.items()}
    return _call(fn, args, kwargs, need, grad, dt)


def _compare(got, want, name, dtype, caps, what, exacts):
    """Each of ``got`` within the tolerance of ``exact``, widened by ``want``'s largest error (module doc)."""
    rtol, atol = tolerance(dtype, name, caps.tolerances)
    for i, (a, b, x) in enumerate(zip(got, want, exacts, strict=True)):
        assert_close_to_exact(a, b, x, rtol, atol, f"{name} {what} output {i} at {dtype}")


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_forward_matches_reference(backend: Backend, caps, dev, name, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    args, kwargs, _ = _inputs(name, dt, dev)
    impl = backend.kernels.select(name, *args, **kwargs)
    got = _run(impl, name, dt, dev, grad=False)
    want = _run(backend.kernels.reference(name), name, dt, dev, grad=False)
    truth = _run(backend.kernels.reference(name), name, dt, dev, grad=False, in_exact=True)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    _compare(got, want, name, dtype, caps, "forward", truth)


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_backward_matches_reference(backend: Backend, caps, dev, name, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    args, kwargs, _ = _inputs(name, dt, dev)
    impl = backend.kernels.select(name, *args, **kwargs)
    got = _run(impl, name, dt, dev, grad=True)
    want = _run(backend.kernels.reference(name), name, dt, dev, grad=True)
    truth = _run(backend.kernels.reference(name), name, dt, dev, grad=True, in_exact=True)
    _compare(got, want, name, dtype, caps, "backward", truth)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_adamw_matches_reference(backend: Backend, caps, dev, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(11)

    base = [torch.randn(33, generator=g), torch.randn(4, 8, generator=g)]
    grads = [torch.randn_like(t) for t in base]
    results = []
    ref = backend.kernels.reference("fused_adamw")
    for fn, d, where, sdt in ((backend.kernels.select("fused_adamw"), dt, dev, torch.float32), (ref, dt, dev, torch.float32),
                              (ref, torch.float64, "cpu", torch.float64)):
        params = [t.to(dt).to(d).to(where) for t in base]
        m = [torch.zeros(t.shape, dtype=sdt, device=where) for t in base]
        v = [torch.zeros(t.shape, dtype=sdt, device=where) for t in base]
        for step in (1, 2, 3):
            fn(params, [gr.to(dt).to(d).to(where) for gr in grads], m, v, step, lr=1e-2, weight_decay=0.1)
        results.append(params)
    _compare(results[0], results[1], "fused_adamw", dtype, caps, "updated parameter", results[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_matmul_matches_exact_emulation(backend: Backend, caps, dev, scaling, dtype):
    """``fp8_matmul`` (kernels/fp8.py) forward and backward, against the exact answer from the
    same FP8 operands: the specified quantisation (scales, rounding) is the contract; only the
    summation may differ, as for any GEMM. The rows and columns span 2^-6..2^6 in magnitude, so a
    wrong scale saturates or underflows the operands and misses by whole FP8 steps (2^-3)."""
    if scaling not in caps.fp8:
        pytest.skip(f"backend does not declare fp8 scaling {scaling!r} (Capabilities.fp8 = {caps.fp8})")
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(13)
    spread = 2.0 ** torch.linspace(-6, 6, 12)
    x = (torch.randn(12, 64, generator=g) * spread[:, None]).to(dt)
    w = (torch.randn(24, 64, generator=g) * spread.repeat(2)[:, None]).to(dt)
    up = torch.randn(12, 24, generator=g).to(dt)

    def run(fn, conv):
        # detach: on a CPU device conv is the identity, and the runs must not share one .grad
        a, b = conv(x).detach().requires_grad_(True), conv(w).detach().requires_grad_(True)
        y = fn(a, b, scaling=scaling)
        y.backward(conv(up))
        return [t.detach() for t in (y, a.grad, b.grad)]

    on_dev = lambda t: t.to(dev)  # noqa: E731
    got = run(backend.kernels.select("fp8_matmul", on_dev(x), on_dev(w), scaling=scaling), on_dev)
    want = run(backend.kernels.reference("fp8_matmul"), on_dev)
    truth = run(backend.kernels.reference("fp8_matmul"), exact)
    assert got[0].dtype == dt and got[0].shape == (12, 24)
    _compare(got, want, "fp8_matmul", dtype, caps, f"{scaling} (out, dx, dw)", truth)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_matmul_uses_a_weight_gathered_in_fp8_as_it_is(backend, caps, dev, dtype):
    """Under ZeRO-3 the engine hands ``fp8_matmul`` a weight already quantised tensorwise
    (``chipset.kernels.fp8.Fp8Weight``: the bytes ``quantize`` makes of it, its scale, and the
    weight for its gradient; runtime/data_parallel.py). Those are the operands the kernel would
    make itself, so the output, dx and dw must be bit for bit those of the call on the weight. The
    weight it is handed holds zeros, as ZeRO-3's placeholder does: its values must not be read."""
    from chipset.kernels.fp8 import FORWARD_FORMAT, Fp8Weight, quantize

    if "tensorwise" not in caps.fp8:
        pytest.skip(f"backend does not declare fp8 scaling 'tensorwise' (Capabilities.fp8 = {caps.fp8})")
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(19)
    x, w, up = (torch.randn(*shape, generator=g).to(dt) for shape in ((16, 32), (48, 32), (16, 48)))

    def run(gathered: bool):
        a = x.to(dev).requires_grad_(True)
        if gathered:
            b = torch.zeros((), dtype=dt, device=dev).expand(w.shape).detach().requires_grad_(True)
            weight = Fp8Weight(*quantize(w.to(dev), FORWARD_FORMAT, "tensorwise", dim=0), b)
        else:
            b = weight = w.to(dev).requires_grad_(True)
        y = backend.kernels("fp8_matmul", a, weight, scaling="tensorwise")
        y.backward(up.to(dev))
        return [t.detach().cpu() for t in (y, a.grad, b.grad)]

    got, want = run(True), run(False)
    for name, a, b in zip(("out", "dx", "dw"), got, want, strict=True):
        assert torch.equal(a, b), f"fp8_matmul on an Fp8Weight, {dtype}: {name} differs from the call on the weight"


EPS32 = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_matches_reference(backend: Backend, caps, dev, dtype, bias):
    """``linear(x, weight, bias)`` = ``x @ weight.T + bias`` forward and backward (dx, dweight,
    dbias), with a non-square weight and two leading dims, against the exact answer. A GEMM may
    order and block its sums any way, so each element gets the bound of a K-term dot product
    summed in float32, ``K * eps32 * sum|a b|`` (K the reduction of that output: in_features + 1
    for y, out_features for dx, rows for dweight and dbias; ``sum|a b|`` the same product of the
    operands' magnitudes), on top of the dtype's tolerance for rounding the result and the
    reference's own largest error. A dropped bias or a wrong transpose misses by whole entries."""
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(17)
    x, w, b, up = (torch.randn(*shape, generator=g).to(dt) for shape in ((3, 5, 48), (24, 48), (24,), (3, 5, 24)))
    operands = (x, w, b) if bias else (x, w)
    names = ("dx", "dweight", "dbias")[: len(operands)]

    def run(fn, conv):
        leaves = [conv(t).detach().requires_grad_(True) for t in operands]  # own leaves: no .grad shared across runs
        y = fn(*leaves)
        y.backward(conv(up).to(y.dtype))
        missing = [n for n, t in zip(names, leaves, strict=True) if t.grad is None]
        assert not missing, f"linear at {dtype}: no gradient for {', '.join(missing)}"
        return [y.detach(), *(t.grad for t in leaves)]

    on_dev = lambda t: t.to(dev)  # noqa: E731
    ref = backend.kernels.reference("linear")
    got = run(backend.kernels.select("linear", *[on_dev(t) for t in operands]), on_dev)
    want = run(ref, on_dev)
    truth = run(ref, exact)
    sizes = [w.shape[1] + 1, w.shape[0], x.numel() // x.shape[-1], x.numel() // x.shape[-1]]
    magnitudes = run(ref, lambda t: exact(t).abs())
    assert got[0].dtype == dt and got[0].shape == (3, 5, 24), f"linear at {dtype}: {got[0].dtype} {tuple(got[0].shape)}"
    rtol, atol = tolerance(dtype, "linear", caps.tolerances)
    for what, a, r, t, k, m in zip(("y", *names), got, want, truth, sizes, magnitudes, strict=False):
        assert_close_to_exact(a, r, t, rtol, atol, f"linear {what} at {dtype} (bias={bias})", summation=k * EPS32 * m)


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_block_matches_reference(backend: Backend, caps, dev, dtype, causal):
    """``attention_block``'s (out, lse) and ``attention_block_backward``'s (dq, dk, dv), given a
    merged out and lse of two blocks, as the reference's (kernels/blockwise.py)."""
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dt).to(dev)

    q, k, v, do = r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16)
    runs = []
    for fwd, bwd, conv in ((backend.kernels.select("attention_block", q, k, v, causal=causal),
                            backend.kernels.select("attention_block_backward", do, q, k, v, q, q[..., 0].float(),
                                                   causal=causal), lambda t: t),
                           (backend.kernels.reference("attention_block"),
                            backend.kernels.reference("attention_block_backward"), lambda t: t),
                           (backend.kernels.reference("attention_block"),
                            backend.kernels.reference("attention_block_backward"), exact)):
        a = [conv(t) for t in (q, k, v, do)]
        out, lse = fwd(*a[:3], causal=causal)
        out2, lse2 = fwd(a[0], a[1].flip(-2), a[2].flip(-2))  # a second block of the same queries
        lse_all = torch.logaddexp(lse.double(), lse2.double()).to(lse.dtype)
        merged = (out.double() * (lse.double() - lse_all.double()).exp().unsqueeze(-1)
                  + out2.double() * (lse2.double() - lse_all.double()).exp().unsqueeze(-1)).to(out.dtype)
        runs.append([out, lse, *bwd(a[3], *a[:3], merged, lse_all, causal=causal)])
    got, want, truth = runs
    _compare(got, want, "attention_block", dtype, caps, "blockwise", truth)


def test_every_reference_kernel_is_dispatchable(backend: Backend):
    for name in REFERENCE_KERNELS:
        assert backend.kernels.has_kernel(name), name


def _variant_inputs(case: str, dt: torch.dtype, dev) -> tuple[str, list, dict]:
    """(kernel, args, kwargs) of one argument variant: every documented parameter at a
    non-default value, edge shapes and non-contiguous inputs."""
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(dev)

    if case == "rms_norm-eps":  # small activations: eps=0.5 dominates mean(x^2)
        return "rms_norm", [r(4, 64, scale=0.1), r(64)], {"eps": 0.5}
    if case == "rms_norm-no_weight-one_row-odd_dim":
        return "rms_norm", [r(1, 7), None], {"eps": 1e-3}
    if case == "rms_norm-non_contiguous":
        return "rms_norm", [r(64, 6).t(), r(64)], {}
    if case == "layer_norm-eps":
        return "layer_norm", [r(4, 64, scale=0.1), r(64), r(64)], {"eps": 0.5}
    if case == "layer_norm-no_affine-non_contiguous":
        return "layer_norm", [r(64, 6).t(), None, None], {"eps": 1e-2}
    if case == "rotary_embedding-non_contiguous":
        ang = torch.randn(8, 16, generator=g)
        return "rotary_embedding", [r(2, 8, 4, 16).transpose(1, 2), ang.cos().to(dt).to(dev), ang.sin().to(dt).to(dev)], {}
    if case == "swiglu-non_contiguous-odd":
        return "swiglu", [r(5, 33)[:, ::2], r(17, 5).t()], {}
    if case == "sdpa-scale-bool_mask":
        mask = torch.rand(1, 1, 8, 8, generator=g) > 0.3
        mask[..., 0] = True
        return "scaled_dot_product_attention", [r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16)], {"mask": mask.to(dev), "scale": 0.3}
    if case == "sdpa-fully_masked_row-gqa-causal":  # a query row with no key to attend gives zeros
        mask = torch.rand(3, 8, generator=g) > 0.3
        mask[:, -1] = True
        mask[1] = False
        return "scaled_dot_product_attention", [r(1, 4, 3, 16), r(1, 2, 8, 16), r(1, 2, 8, 16)], {"mask": mask.to(dev), "causal": True}
    if case == "sdpa-gqa-causal-fewer_queries":
        return "scaled_dot_product_attention", [r(1, 4, 3, 16), r(1, 2, 8, 16), r(1, 2, 8, 16)], {"causal": True}
    if case == "sdpa-additive_mask":
        return "scaled_dot_product_attention", [r(2, 2, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)], {"mask": r(1, 1, 5, 5)}
    if case == "cross_entropy-ignore_index-sum":
        target = torch.randint(0, 32, (8,), generator=g)
        target[::3] = 5
        return "cross_entropy", [r(8, 32), target.to(dev)], {"ignore_index": 5, "reduction": "sum"}
    if case == "cross_entropy-none-default_ignore":
        target = torch.randint(0, 32, (8,), generator=g)
        target[1] = -100
        return "cross_entropy", [r(8, 32), target.to(dev)], {"reduction": "none"}
    raise KeyError(case)


VARIANTS = [
    "rms_norm-eps", "rms_norm-no_weight-one_row-odd_dim", "rms_norm-non_contiguous", "layer_norm-eps",
    "layer_norm-no_affine-non_contiguous", "rotary_embedding-non_contiguous", "swiglu-non_contiguous-odd",
    "sdpa-scale-bool_mask", "sdpa-fully_masked_row-gqa-causal", "sdpa-gqa-causal-fewer_queries", "sdpa-additive_mask",
    "cross_entropy-ignore_index-sum", "cross_entropy-none-default_ignore",
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", VARIANTS)
def test_argument_variants_match_reference(backend: Backend, caps, dev, case, dtype):
    """Dispatch honours every argument (a kernel that ignores ``eps`` or a mask fails here)."""
    _require(caps, dtype)
    dt = FLOATS[dtype]
    name, args, kwargs = _variant_inputs(case, dt, dev)
    got = backend.kernels.select(name, *args, **kwargs)(*args, **kwargs)
    want = backend.kernels.reference(name)(*args, **kwargs)
    truth = backend.kernels.reference(name)(*[exact(a) for a in args], **{k: exact(v) for k, v in kwargs.items()})
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{case}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}")
    _compare([got.detach()], [want.detach()], name, dtype, caps, f"forward ({case})", [truth.detach()])
