"""FP8 all-gather under ZeRO-3 (train.fp8 = tensorwise, train.fp8_all_gather; runtime/data_parallel.py).

Each rank quantises its shard of a projection weight with the scale of the whole weight (a
global amax, all-reduced MAX) and the FP8 bytes are all-gathered; ``fp8_matmul`` reads them as
they are. Quantisation is elementwise once the scale is fixed, so the gathered bytes must be
bit for bit what the GEMM makes of the gathered weight: the checks here are equalities, not
tolerances (a scale from the shard's own amax, tried by hand, breaks every one of them).

One 2-rank job (dp=2, zero=3, float32) trains the same steps with the FP8 all-gather and without
it, and inspects the engine it trained; the kernel and planner checks run in this process.
This file is also the job's script.

The FP8 weights get ZeRO-3 buckets of their own, so the gradient norm is summed over other
buckets in another order: with clipping off the update is elementwise and the two runs are one
run bit for bit; with clipping on the clip factor may differ in its last float32 bit, which the
next FP8 quantisation may round to one step of e4m3 (u = 2^-4), so those runs are held to the
documented FP8 loss tolerance (docs/engine.md, "FP8 training"; tests/parallel/test_fp8.py):
``|loss - loss_ref| <= sqrt(2/3) u loss_ref``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import multirank
import testenv

HERE = Path(__file__).resolve()
STEPS = 4
BASE = multirank.merge(testenv.TINY_RUN, {"train": {"steps": STEPS, "fp8": "tensorwise"},
                                          "parallel": {"dp": 2, "zero": 3}})
REL_TOL = (2 / 3) ** 0.5 * 2.0**-4
PROJECTIONS = 7  # q, k, v, o, gate, up, down per block: the layers train.fp8 routes


def _train(b, overrides: dict) -> dict:
    from chipset.train.config import RunConfig
    from chipset.train.loop import build, lr_at, rank_batches, train_step

    cfg = RunConfig.from_dict(multirank.merge(BASE, overrides)).validate(world_size=b.collective.world_size())
    engine, data, _ = build(cfg, b)
    b.collective.reset_stats()
    losses = [train_step(engine, rank_batches(data, s, engine, engine.micro_batches), lr_at(cfg, s))[0]
              for s in range(STEPS)]
    gathered = b.collective.stats_dict().get(f"all_gather@{engine.group.name}", {}).get("bytes", 0)
    return {"engine": engine, "losses": losses, "all_gather_bytes": gathered, "digest": engine.params_digest()}


def _inspect(b, engine) -> dict:
    """Per FP8 bucket of the trained engine: its gathered bytes and scales against ``quantize`` of
    the gathered weight, and the bytes each kind of gather moves (the collective's accounting)."""
    from chipset.kernels.fp8 import FORWARD_FORMAT, quantize
    from chipset.parallel.fp8 import GATHERED

    out = {"equal": [], "fp8_bytes": 0, "dtype_bytes": 0, "shard": 0, "names": []}
    key = f"all_gather@{engine.group.name}"
    for bucket in (x for x in engine.buckets if x.fp8):
        out["names"] += bucket.names
        b.collective.reset_stats()
        bucket.gather_fp8()
        out["fp8_bytes"] += b.collective.stats_dict()[key]["bytes"]
        b.collective.reset_stats()
        bucket.gather()
        out["dtype_bytes"] += b.collective.stats_dict()[key]["bytes"]
        out["shard"] += bucket.shard
        for p in bucket.params:
            got = getattr(p, GATHERED)
            want_q, want_s = quantize(p.detach(), FORWARD_FORMAT, "tensorwise", dim=0)
            out["equal"].append(bool(torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8))
                                     and torch.equal(got.scale, want_s)))
        bucket.release()
    return out


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    res = {}
    for name, on, clip in (("fp8", True, 0.0), ("dtype", False, 0.0), ("fp8_clip", True, 1.0),
                           ("dtype_clip", False, 1.0)):
        run = _train(b, {"train": {"fp8_all_gather": on, "grad_clip": clip}})
        engine = run.pop("engine")
        if name == "fp8":
            run.update(_inspect(b, engine))
        res[name] = run
        del engine
    from chipset.train.config import RunConfig
    from chipset.train.loop import build

    cfg = RunConfig.from_dict(multirank.merge(BASE, {"train": {"fp8": "rowwise"}})).validate(world_size=2)
    res["rowwise_fp8_buckets"] = sum(x.fp8 for x in build(cfg, b)[0].buckets)
    multirank.finish(b, res, out_path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    import chipset

    if "tensorwise" not in chipset.backend().capabilities.fp8:
        pytest.skip("the default backend does not declare tensorwise FP8 GEMMs (Capabilities.fp8)")
    multirank.require(2)
    return multirank.run_jobs(HERE, [{"dp2": 2}], tmp_path_factory.mktemp("fp8ag"), timeout=400)["dp2"]


@pytest.mark.multirank
def test_gathered_fp8_bytes_are_the_quantised_gathered_weight(job):
    got = job["fp8"]
    assert len(got["names"]) == PROJECTIONS * BASE["model"]["num_hidden_layers"]
    assert all(n.endswith(".weight") for n in got["names"])
    assert got["equal"] and all(got["equal"]), got["names"]


@pytest.mark.multirank
def test_training_with_the_fp8_all_gather_is_the_same_run_bit_for_bit(job):
    fp8, dtype = job["fp8"], job["dtype"]
    assert fp8["losses"] == dtype["losses"]
    assert fp8["digest"] == dtype["digest"]
    assert dtype["losses"][-1] < dtype["losses"][0]  # it trains


@pytest.mark.multirank
def test_with_clipping_it_stays_within_the_fp8_tolerance_of_the_run_gathering_in_the_dtype(job):
    got, ref = job["fp8_clip"]["losses"], job["dtype_clip"]["losses"]
    for step, (a, b) in enumerate(zip(got, ref, strict=True), 1):
        assert abs(a - b) <= REL_TOL * b, f"step {step}: fp8 all-gather loss {a}, dtype all-gather {b}"


@pytest.mark.multirank
def test_fp8_all_gather_moves_a_quarter_of_the_float32_bytes(job):
    fp8 = job["fp8"]
    assert fp8["fp8_bytes"] == fp8["shard"]  # one byte a parameter, from the collective's accounting
    assert fp8["dtype_bytes"] == 4 * fp8["shard"]
    assert fp8["all_gather_bytes"] < job["dtype"]["all_gather_bytes"]


@pytest.mark.multirank
def test_rowwise_scaling_gathers_in_the_run_dtype(job):
    assert job["rowwise_fp8_buckets"] == 0


def test_fp8_matmul_on_an_fp8_weight_equals_it_on_the_weight():
    from chipset.kernels.fp8 import FORWARD_FORMAT, Fp8Weight, fp8_matmul, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    dy = torch.randn(6, 8, generator=g)
    want = fp8_matmul(x, w)
    want.backward(dy)
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    q, s = quantize(w.detach(), FORWARD_FORMAT, "tensorwise", dim=0)
    placeholder = torch.zeros(()).expand(w.shape).detach().requires_grad_(True)  # as ZeRO-3's: never read
    got = fp8_matmul(x, Fp8Weight(q, s, placeholder))
    got.backward(dy)
    assert torch.equal(got, want)
    assert torch.equal(x.grad, grads[0]) and torch.equal(placeholder.grad, grads[1])
    with pytest.raises(ValueError, match="tensorwise"):
        fp8_matmul(x, Fp8Weight(q, s, w), scaling="rowwise")


def test_planner_counts_one_byte_a_parameter_for_fp8_gathered_weights():
    from chipset.planner.comm import data_parallel_items
    from chipset.planner.run import from_run_config
    from chipset.train.config import RunConfig

    def gathers(fp8: str, on: bool = True) -> float:
        over = {"train": {"fp8": fp8, "fp8_all_gather": on, "dtype": "bfloat16"}}
        cfg = RunConfig.from_dict(multirank.merge(BASE, over))
        m, lay, train = from_run_config(cfg, world_size=2)
        items = data_parallel_items(lay, train, _cluster(), m.num_params(), 0, 1)
        return sum(i.bytes for i in items if i.op == "all_gather"), train

    off, train_off = gathers("off")
    on, train_on = gathers("tensorwise")
    f = train_on.fp8_gather_fraction
    assert train_off.fp8_gather_fraction == 0 and gathers("rowwise")[1].fp8_gather_fraction == 0
    assert gathers("tensorwise", on=False)[1].fp8_gather_fraction == 0
    assert 0 < f < 1
    assert on == pytest.approx(off * (1 - f / 2))  # bf16: those parameters at 1 byte instead of 2


def _cluster():
    from chipset.planner.cluster import resolve_cluster

    return resolve_cluster("1x2:h100-sxm")


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
