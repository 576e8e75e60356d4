"""bfloat16 training without float32 master weights (train.master_weights = "none", runtime/bf16_update.py).

Stochastic rounding is unbiased: each draw is one of the two bfloat16 neighbours of ``x``, so its
variance is at most ``ulp^2 / 4`` and the mean of ``N`` draws lies within ``Z * ulp / (2 sqrt N)``
of ``x`` (``Z = 6``: a false failure about once in 10^9); rounding to nearest misses it by 0.3 ulp.

The point of the feature, through the engine on a model whose gradient does not depend on the
weights (``w . x`` with ``x = 1``): AdamW's update is then ``lr`` every step whatever the
weights, so the float32-master run is the exact trajectory ``w0 - k lr`` and the others are
compared with it element by element. With ``lr`` a tenth of a bfloat16 step, rounding to nearest
loses every update (the weights never move); Kahan's weights stay within half a step of the
master (plus what the bfloat16 compensation rounds, ``2^-10`` step per step); stochastic
rounding adds an independent zero-mean error below one step each step, so the mean over ``n``
weights is within ``Z * ulp * sqrt(k) / (2 sqrt n)`` of the master's. Both also allow the
float32 rounding of ``w - lr`` in each run (``2^-24`` relative, per step).

The planner's K (planner/run.py) plus the 2 bytes of a bfloat16 parameter equals the bytes per
parameter the engine holds for parameters, masters and state, with and without masters.

Multirank (dp = 2): with ZeRO 0 every rank applies the whole stochastic update to its replica,
and the replicas stay bit-identical (the noise is seeded by step and bucket, not by rank); with
ZeRO 2 (stochastic) and ZeRO 3 (Kahan: its compensation is optimizer state) a run checkpointed
halfway and resumed equals the uninterrupted one bit for bit.
This file is also the jobs' script.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch

import multirank
import testenv

HERE = Path(__file__).resolve()
Z = 6.0
BF16 = {"train": {"dtype": "bfloat16", "master_weights": "none"}}
N, STEPS, W0 = 4096, 40, 1.5
ULP = 2.0**-7  # bfloat16's step in [1, 2)
LR = ULP / 10


class _Dot(torch.nn.Module):
    """loss = w . x: the gradient is x whatever w is."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((N,), W0))

    def loss(self, x, _y):
        return (self.w.float() * x.float()).sum()


def _dot_run(b, update) -> dict[str, torch.Tensor]:
    from chipset.parallel.dims import ParallelDims
    from chipset.runtime.bf16_update import Bf16Update
    from chipset.runtime.data_parallel import DataParallel
    from chipset.runtime.optim import AdamW

    eng = DataParallel(_Dot(), b, ParallelDims(dp=1), dtype=torch.bfloat16, grad_clip=0.0, optimizer=AdamW(),
                       bf16_update=None if update is None else Bf16Update(update, seed=5))
    x = torch.ones(N, device=eng.device)
    for _ in range(STEPS):
        eng.forward_backward(x, None)
        eng.step(LR)
    (bucket,) = eng.buckets
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # a master-free master is the parameters
            for t in (bucket.full, bucket.master, *bucket.state.values())}
    out = {"params": eng.model.w.detach().float().cpu(), "master": bucket.master.detach().float().cpu()[:N],
           "bytes_per_param": sum(held.values()) / N}
    if "compensation" in bucket.state:
        out["exact"] = out["params"] + bucket.state["compensation"].float().cpu()[:N]
    return out


def _train(b, over: dict, run_dir=None, resume: str = "none", keep_params: bool = False):
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(multirank.merge(testenv.TINY_RUN, over)).validate(world_size=b.collective.world_size())
    return train(cfg, b, run_dir, out=io.StringIO(), resume=resume, keep_params=keep_params)


def _resume_pair(b, over: dict, tmp: Path) -> dict:
    ckpt = multirank.merge(over, {"train": {"checkpoint_every": 4}})
    whole = _train(b, over)
    first = _train(b, multirank.merge(ckpt, {"train": {"steps": 4}}), tmp)
    resumed = _train(b, ckpt, tmp, resume="auto")
    return {"whole": (whole.losses, whole.summary["params_digest"]), "first": first.losses,
            "resumed": (resumed.losses, resumed.summary["params_digest"])}


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    tmp = Path(out_path).parent / mode
    if mode == "one":
        results = {u or "float32": _dot_run(b, u) for u in (None, "nearest", "stochastic", "kahan")}
    else:
        replicas = _train(b, multirank.merge(BF16, {"parallel": {"zero": 0}}), keep_params=True)
        flat = torch.cat([p.reshape(-1) for p in replicas.params.values()]).to(torch.float32)
        every = torch.empty(flat.numel() * 2, dtype=torch.float32, device=flat.device)
        b.collective.all_gather(every, flat.to(every.device))
        results = {"replicas_equal": torch.equal(*every.cpu().chunk(2)), "replica_losses": replicas.losses,
                   "stochastic": _resume_pair(b, multirank.merge(BF16, {"parallel": {"zero": 2}}), tmp / "sr"),
                   "kahan": _resume_pair(b, multirank.merge(BF16, {"parallel": {"zero": 3},
                                                                   "train": {"bf16_update": "kahan"}}), tmp / "kahan")}
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(2)
    return multirank.run_jobs(HERE, [{"one": 1, "dp2": 2}], tmp_path_factory.mktemp("bf16"), timeout=400)


def test_stochastic_rounding_is_unbiased():
    from chipset.runtime.bf16_update import stochastic_round

    draws = 40_000
    for x0, ulp in ((1.0 + 0.3 * 2**-7, 2**-7), (-3.0 - 0.7 * 2**-6, 2**-6), (2**-10 * (1 + 0.01 * 2**-7), 2**-17)):
        x = torch.full((draws,), x0, dtype=torch.float32)
        got = stochastic_round(x, torch.Generator().manual_seed(1)).double()
        lo, hi = math.floor(x0 / ulp) * ulp, math.ceil(x0 / ulp) * ulp
        assert set(got.unique().tolist()) <= {lo, hi}, f"{x0}: draws outside its neighbours {lo}, {hi}"
        bound = Z * ulp / (2 * math.sqrt(draws))
        assert abs(got.mean().item() - float(x[0])) <= bound, f"{x0}: mean {got.mean().item()}, bound {bound}"
    again = stochastic_round(x, torch.Generator().manual_seed(1)).double()
    assert torch.equal(again, got)  # seeded: reproducible


def test_plain_rounding_stalls_where_stochastic_and_kahan_track_the_float32_master(runs):
    one = runs["one"]
    master = one["float32"]["master"]
    fp32 = 2 * STEPS * 2.0**-24 * W0  # float32 rounding of w - lr in each run
    assert (master - (W0 - STEPS * LR)).abs().max() <= fp32  # the reference moved k lr
    assert torch.equal(one["nearest"]["params"], torch.full((N,), W0))  # every update lost
    kahan = one["kahan"]
    assert (kahan["params"] - master).abs().max() <= ULP / 2 + STEPS * ULP * 2.0**-10 + fp32
    assert (kahan["exact"] - master).abs().max() <= STEPS * ULP * 2.0**-10 + fp32
    sr = one["stochastic"]["params"]
    bound = Z * ULP * math.sqrt(STEPS) / (2 * math.sqrt(N)) + fp32
    assert abs((sr - master).mean().item()) <= bound, f"stochastic mean error {(sr - master).mean().item()}, bound {bound}"


def test_the_planner_counts_the_bytes_the_engine_holds(runs):
    from chipset.planner.run import optimizer_bytes
    from chipset.train.config import TrainConfig

    for update in ("float32", "stochastic", "kahan"):
        tr = TrainConfig(dtype="bfloat16", **({} if update == "float32" else {"master_weights": "none", "bf16_update": update}))
        assert 2 + optimizer_bytes(tr, masters_are_params=False) == runs["one"][update]["bytes_per_param"]


def test_replicas_stay_bit_identical_under_stochastic_rounding(runs):
    dp2 = runs["dp2"]
    assert dp2["replicas_equal"]
    assert dp2["replica_losses"][-1] < dp2["replica_losses"][0] - 0.1


@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_master_free_run_round_trips_through_a_checkpoint(runs, update):
    got = runs["dp2"][update]
    (whole_losses, whole_digest), (resumed_losses, resumed_digest) = got["whole"], got["resumed"]
    assert got["first"] == whole_losses[:4]
    assert resumed_losses == whole_losses[4:]
    assert resumed_digest == whole_digest


def test_master_weights_none_refuses_what_it_does_not_support():
    from chipset.errors import ConfigError
    from chipset.train.config import RunConfig

    def problems(over):
        with pytest.raises(ConfigError) as err:
            RunConfig.from_dict(multirank.merge(testenv.TINY_RUN, over)).validate(world_size=2)
        return str(err.value)

    assert "needs train.dtype = 'bfloat16' (found 'float32')" in problems({"train": {"master_weights": "none"}})
    assert "dp with ZeRO 0-3 only (found parallel.tp = 2)" in problems(multirank.merge(BF16, {"parallel": {"tp": 2}}))
    assert "applies only with train.master_weights = 'none'" in problems({"train": {"bf16_update": "kahan"}})
    assert "expected one of stochastic, kahan, nearest" in problems(multirank.merge(BF16, {"train": {"bf16_update": "up"}}))


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
