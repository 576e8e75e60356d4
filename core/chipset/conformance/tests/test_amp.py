"""AMP: autocast on the backend's device type computes in each declared AMP dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from chipset.loader import Backend

AMP = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _need(caps, name):
    if name not in caps.amp_dtypes:
        pytest.skip(f"backend does not declare AMP dtype {name}")


@pytest.mark.parametrize("name", list(AMP))
def test_matmul_runs_in_the_amp_dtype(backend: Backend, caps, dev, name):
    _need(caps, name)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g).to(dev), torch.randn(32, 8, generator=g).to(dev)
    dt = AMP[name]
    with torch.autocast(device_type=backend.device.device_type, dtype=dt):
        y = a @ b
    assert y.dtype == dt
    # Reference: the same product of the inputs rounded to the AMP dtype, in float32;
    # the autocast result differs by its own output rounding (2 eps relative covers it).
    want = a.to(dt).float() @ b.to(dt).float()
    torch.testing.assert_close(y.float(), want, rtol=2 * torch.finfo(dt).eps, atol=1e-3)


@pytest.mark.parametrize("name", list(AMP))
def test_linear_backward_gives_fp32_grads_for_fp32_params(backend: Backend, caps, dev, name):
    _need(caps, name)
    lin = torch.nn.Linear(32, 8).to(dev)
    x = torch.randn(4, 32, device=dev)
    with torch.autocast(device_type=backend.device.device_type, dtype=AMP[name]):
        out = lin(x)
    assert out.dtype == AMP[name]
    out.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("name", list(AMP))
def test_autocast_leaves_code_outside_untouched(backend: Backend, caps, dev, name):
    _need(caps, name)
    a = torch.randn(8, 8, device=dev)
    with torch.autocast(device_type=backend.device.device_type, dtype=AMP[name]):
        pass
    assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("name", list(AMP))
def test_disabled_autocast_region_stays_fp32(backend: Backend, caps, dev, name):
    _need(caps, name)
    a = torch.randn(8, 8, device=dev)
    dt = backend.device.device_type
    with torch.autocast(device_type=dt, dtype=AMP[name]):
        with torch.autocast(device_type=dt, enabled=False):
            y = a @ a
    assert y.dtype == torch.float32
