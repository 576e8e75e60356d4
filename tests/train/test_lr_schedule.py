"""Learning-rate schedules after warm-up: endpoints and shapes (chipset.train.lr)."""

from __future__ import annotations

import math

import pytest

from chipset.cli.main import main
from chipset.train.config import TrainConfig
from chipset.train.lr import lr_at


def _lrs(**kw):
    tr = TrainConfig(**{"steps": 20, "lr": 1.0, "warmup_steps": 4, **kw})
    return [lr_at(tr, s) for s in range(tr.steps)]


def test_warmup_then_constant():
    lrs = _lrs()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and set(lrs[4:]) == {1.0}


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decays_reach_min_lr_at_the_last_step_and_never_rise(name):
    lrs = _lrs(lr_schedule=name, min_lr=0.1)
    assert lrs[3] == 1.0 and math.isclose(lrs[-1], 0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))


def test_cosine_is_halfway_at_the_midpoint():
    tr = TrainConfig(steps=11, lr=1.0, warmup_steps=0, lr_schedule="cosine", min_lr=0.0)
    assert math.isclose(lr_at(tr, 5), 0.5) and lr_at(tr, 2) > 1 - 2 / 10  # above the linear line early


def test_wsd_is_stable_then_decays_over_the_last_fraction():
    lrs = _lrs(lr_schedule="wsd", min_lr=0.0, decay_fraction=0.25)  # 16 post-warm-up steps, 4 decaying
    assert set(lrs[3:16]) == {1.0}
    assert lrs[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("kv, expect", [
    ("train.lr_schedule=exp", "train.lr_schedule = 'exp': expected one of constant, linear, cosine, wsd"),
    ("train.min_lr=1.0", "train.min_lr = 1.0: expected a finite value in [0, train.lr"),
    ("train.decay_fraction=0", "train.decay_fraction = 0.0: expected a fraction in (0, 1]"),
])
def test_bad_schedule_keys_exit_2(tmp_path, capsys, kv, expect):
    assert main(["train", "--set", kv, "--run-dir", str(tmp_path / "r")]) == 2
    assert expect in capsys.readouterr().err
