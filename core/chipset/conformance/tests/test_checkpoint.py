"""Checkpoint round trip: device tensors and RNG state survive chipset's checkpoint format.

Tensors leave the device as host copies, are written through torch.distributed.checkpoint
with chipset's manifest (atomic commit, checksums), verified, read back with the
allow-list metadata reader and moved back to the device: bit-identical for every
declared floating dtype, and the device RNG stream replays after its state round-trips.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import pytest
import torch

from chipset.train.checkpoint import store

if TYPE_CHECKING:
    from chipset.loader import Backend

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _round_trip(tmp_path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    tmp = tmp_path / "checkpoints" / ".tmp-step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                 storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    (tmp / store.STATE).write_text('{"step": 1}\n')  # every complete checkpoint has one (store.verify)
    names = sorted(p.name for p in tmp.iterdir())
    final = store.checkpoint_dir(tmp_path, 1)
    store.commit(tmp, final, 1, store.hash_files(tmp, names), {})
    assert store.verify(final) is None
    back = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=store.safe_reader(final), no_dist=True)
    return back


def test_device_tensors_round_trip_bit_exact(backend: Backend, caps, dev, tmp_path):
    declared = {n: d for n, d in FLOATS.items() if n in caps.dtypes}
    if not declared:
        pytest.skip("backend declares no floating dtype")
    g = torch.Generator().manual_seed(0)
    src = {f"model.w_{n}": torch.randn(5, 7, generator=g).to(d).to(dev) for n, d in declared.items()}
    src["optim.step"] = torch.arange(3, dtype=torch.int64).to(dev)
    back = _round_trip(tmp_path, src)
    for k, v in src.items():
        got = back[k].to(dev)
        assert got.dtype == v.dtype and got.device.type == v.device.type
        assert torch.equal(got.cpu(), v.cpu()), k


def test_rng_state_round_trips_through_a_checkpoint(backend: Backend, dev, tmp_path):
    d = backend.device
    d.manual_seed(2024)
    state = d.get_rng_state()
    expected = torch.rand(32, device=dev).cpu()
    back = _round_trip(tmp_path, {"rng.device.rank0": state})
    d.manual_seed(1)  # disturb the stream
    d.set_rng_state(back["rng.device.rank0"])
    assert torch.equal(torch.rand(32, device=dev).cpu(), expected)
