"""chipset diagnose on 2-rank cpu_sim runs whose input misbehaves: a slow data loader on one rank
and a bad batch that makes the loss spike.

Both come through the engine's data hook, a model family's ``data(cfg)`` (docs/models.md): the
family below is a small regression MLP whose data sleeps on one dp rank (``model.slow_rank``,
``model.slow_ms``) or returns one batch with its targets in the wrong unit (``model.bad_step``,
0-based, targets times ``model.bad_scale``). Runs select it with ``model.family =
"test_diagnose_data:family"`` and this folder on PYTHONPATH, as a user's own family would be.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from chipset.cli.main import main
from chipset.models.family import ModelFamily
from testenv import SideBySide, chipset_train, family_env

HERE = Path(__file__).resolve().parent
FEATURES = 8


@dataclass
class InputFaults:
    """The family's own [model] keys: what its data does wrong."""

    slow_rank: int = -1
    """The dp rank whose batches take ``slow_ms`` longer to arrive (-1: none)."""
    slow_ms: int = 0
    bad_step: int = -1
    """The 0-based step whose batch has its targets multiplied by ``bad_scale`` (-1: none)."""
    bad_scale: float = 100.0


class Regression:
    """Samples x ~ N(0, I), targets x @ w; sample i is the same on every layout."""

    def __init__(self, global_batch: int, faults: InputFaults):
        self.global_batch, self.faults = global_batch, faults
        self.w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(3))

    def batch(self, step, dp_rank=0, dp=1, micro=0, micro_batches=1, device=None):
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = step * self.global_batch + dp_rank * per_rank + micro * mb
        x = torch.randn(mb, FEATURES, generator=torch.Generator().manual_seed(first))
        y = x @ self.w
        if dp_rank == self.faults.slow_rank:
            time.sleep(self.faults.slow_ms / 1000)  # a slow input pipeline: a disk, a decoder, a queue
        if step == self.faults.bad_step:
            y = y * self.faults.bad_scale  # labels in the wrong unit
        return x.to(device), y.to(device)


class RegressionFamily(ModelFamily):
    name = "diagnose-regression"
    config_class = InputFaults

    def build(self, cfg):
        return nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, 1))

    def output_loss(self, outputs, targets):
        return nn.functional.mse_loss(outputs.float(), targets.float())

    def data(self, cfg):
        return Regression(cfg.train.global_batch, self.options(cfg))


def family() -> RegressionFamily:
    return RegressionFamily()


# --- the runs ---------------------------------------------------------------------------

RUNS = {
    "slow_loader": ["model.slow_rank=1", "model.slow_ms=200"],
    "bad_batch": ["model.bad_step=4"],  # record step 5
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("diagnose-data")

    def job(name):
        def start():
            sets = ['model.family="test_diagnose_data:family"', "train.steps=7", "train.global_batch=16",
                    *RUNS[name]]
            r = chipset_train(base / name, 2, sets, env=family_env(str(HERE)), timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            (base / f"{name}.out").write_text(r.stdout + r.stderr)
            return base / name
        return start

    started = SideBySide({name: job(name) for name in RUNS})
    yield started
    started.close()


def _diagnose(run_dir, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diagnose", str(run_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.multirank
def test_a_slow_loader_is_a_data_loader_stall_on_its_rank(runs, capsys):
    code, out = _diagnose(runs["slow_loader"], capsys)
    first = out["findings"][0]
    assert (first["kind"], first["rank"], first["step"], first["severity"]) == (
        "data_loader_stall", 1, 2, "error"), out["findings"]  # step 1 is warm-up
    assert code == 1
    # Its compute time is long too (the wait is inside it): a straggler blamed on its input, below.
    strag = [f for f in out["findings"] if f["kind"] == "straggler"]
    assert [(f["rank"], f["evidence"]["cause"], f["severity"]) for f in strag] == [(1, "input pipeline", "warning")]
    console = (runs["slow_loader"].parent / "slow_loader.out").read_text()
    assert "chipset: warning: rank 1 is a straggler" in console and "waiting for its batches" in console


@pytest.mark.multirank
def test_a_bad_batch_is_a_loss_spike_at_its_step(runs, capsys):
    code, out = _diagnose(runs["bad_batch"], capsys)
    first = out["findings"][0]
    assert (first["kind"], first["step"], first["severity"]) == ("loss_spike", 5, "error"), out["findings"]
    assert first["evidence"]["grad_norm_ratio"] >= 10  # the same event: no separate gradient finding
    assert "grad_norm_explosion" not in [f["kind"] for f in out["findings"]]
    assert code == 1
