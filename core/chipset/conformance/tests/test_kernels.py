"""Kernels: what dispatch runs on the backend matches the core reference, forward and backward.

Each kernel is run through the backend's registry (its own implementation where it
registers one, else the reference) and compared with the core reference on the same
device and dtype. Tolerances: DESIGN.md's table (chipset.conformance.TOLERANCES), or
the backend's documented override in ``Capabilities.tolerances`` keyed ``"kernel/dtype"``
or ``"dtype"``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from chipset.conformance import tolerance
from chipset.kernels import REFERENCE_KERNELS

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
    raise KeyError(name)


DIFFERENTIABLE = [k for k in REFERENCE_KERNELS if k != "fused_adamw"]


def _require(caps, dtype):
    if dtype not in caps.dtypes:
        pytest.skip(f"backend does not declare dtype {dtype}")


def _run(fn, name, dt, dev, grad: bool):
    args, kwargs, need = _inputs(name, dt, dev)
    if grad:
        args = [a.detach().requires_grad_(True) if i in need else a for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    if not grad:
        return [out.detach()]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype).to(out.device)
    out.backward(upstream)
    return [args[i].grad for i in need]


def _compare(got, want, name, dtype, caps, what):
    rtol, atol = tolerance(dtype, name, caps.tolerances)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol,
            msg=lambda m, i=i: f"{name} {what} output {i} at {dtype} (rtol={rtol}, atol={atol}): {m}",
        )


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_forward_matches_reference(backend, caps, dev, name, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    args, kwargs, _ = _inputs(name, dt, dev)
    impl = backend.kernels.select(name, *args, **kwargs)
    got = _run(impl, name, dt, dev, grad=False)
    want = _run(backend.kernels.reference(name), name, dt, dev, grad=False)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    _compare(got, want, name, dtype, caps, "forward")


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_backward_matches_reference(backend, caps, dev, name, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    args, kwargs, _ = _inputs(name, dt, dev)
    impl = backend.kernels.select(name, *args, **kwargs)
    got = _run(impl, name, dt, dev, grad=True)
    want = _run(backend.kernels.reference(name), name, dt, dev, grad=True)
    _compare(got, want, name, dtype, caps, "backward")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_adamw_matches_reference(backend, caps, dev, dtype):
    _require(caps, dtype)
    dt = FLOATS[dtype]
    g = torch.Generator().manual_seed(11)

    base = [torch.randn(33, generator=g), torch.randn(4, 8, generator=g)]
    grads = [torch.randn_like(t) for t in base]
    results = []
    for fn in (backend.kernels.select("fused_adamw"), backend.kernels.reference("fused_adamw")):
        params = [t.to(dt).to(dev) for t in base]
        m = [torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in base]
        v = [torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in base]
        for step in (1, 2, 3):
            fn(params, [gr.to(dt).to(dev) for gr in grads], m, v, step, lr=1e-2, weight_decay=0.1)
        results.append(params)
    _compare(results[0], results[1], "fused_adamw", dtype, caps, "updated parameter")


def test_every_reference_kernel_is_dispatchable(backend):
    for name in REFERENCE_KERNELS:
        assert backend.kernels.has_kernel(name), name
