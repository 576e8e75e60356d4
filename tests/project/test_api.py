"""chipset.api refuses misuse with errors that say what to do (docs/library.md).

The calls run in a child process: ``api.init`` joins a process group (a world of one here), which
must not outlive the call in pytest's own process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from chipset import ConfigError, api
from testenv import clean_env

_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from chipset import ConfigError, UsageError, api

    cfg = api.config(train={"global_batch": 4})
    backend = api.init(cfg)
    try:
        api.parallelize(cfg, backend, "resnet")
    except UsageError as exc:
        print("bad model:", exc)
    try:  # checked before the layout, so one process can see it
        api.parallelize(api.config(parallel={"tp": 2}), backend, nn.Linear(3, 2))
    except ConfigError as exc:
        print("no plan:", exc)
    with torch.device("meta"):
        empty = nn.Linear(3, 2)
    try:  # a meta-device model has no values to train
        api.parallelize(cfg, backend, empty)
    except UsageError as exc:
        print("meta model:", exc)
    engine = api.parallelize(cfg, backend, nn.Linear(3, 2))
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    try:
        api.step(engine, [(x, y), (x, y)], 0.01)
    except ConfigError as exc:
        print("bad batches:", exc)
    loss, stats = api.step(engine, [(x, y)], api.lr_at(cfg, 0))
    print("loss", loss, sorted(stats))
    api.shutdown(backend)
""")


def test_config_takes_tables_then_overrides_and_refuses_unknown_keys():
    cfg = api.config(parallel={"zero": 2}, train={"lr": 0.5}, overrides=["train.lr=0.25"])
    assert (cfg.parallel.zero, cfg.train.lr) == (2, 0.25)
    with pytest.raises(ConfigError, match="unknown key.*did you mean"):
        api.config(train={"stpes": 3})


def test_parallelize_and_step_refuse_misuse_in_one_process():
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bad model: parallelize: model is str; expected an nn.Module" in r.stdout
    assert "no plan: parallel.tp = 2 splits the model by a tensor-parallel plan" in r.stdout
    assert "meta model: parameter 'weight' of Linear is on the meta device (it has no values)" in r.stdout
    assert "bad batches: train_step got 2 micro-batch(es), the engine was built for 1" in r.stdout
    assert "loss " in r.stdout and "['grad_norm', 'loss_scale', 'skipped']" in r.stdout
