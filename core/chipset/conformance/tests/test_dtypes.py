"""Dtypes: every declared dtype works on the device; an undeclared one is refused clearly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from chipset.errors import UnsupportedDTypeError

if TYPE_CHECKING:
    from chipset.loader import Backend

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
}


@pytest.mark.parametrize("name", list(DTYPES))
def test_declared_dtype_works(backend: Backend, caps, dev, name):
    if name not in caps.dtypes:
        pytest.skip(f"backend does not declare dtype {name}")
    dt = DTYPES[name]
    backend.device.check_dtype(dt)
    host = (torch.arange(16) % 2).to(dt)
    x = host.to(dev)
    assert x.dtype == dt and x.device.type == backend.device.device_type
    y = (x.to(torch.int64) + 1).to(dt) if dt is not torch.bool else ~x
    back = y.cpu()
    want = (host.to(torch.int64) + 1).to(dt) if dt is not torch.bool else ~host
    assert torch.equal(back, want)


def test_undeclared_dtypes_are_refused_clearly(backend: Backend, caps):
    exotic = {"complex64": torch.complex64, "complex128": torch.complex128}
    undeclared = {n: d for n, d in {**DTYPES, **exotic}.items() if n not in caps.dtypes}
    assert undeclared, "every dtype is declared; nothing to refuse"
    for name, dt in undeclared.items():
        with pytest.raises(UnsupportedDTypeError) as info:
            backend.device.check_dtype(dt)
        msg = str(info.value)
        assert name in msg and any(d in msg for d in caps.dtypes), msg
