"""Models outside the reference family: counted on meta tensors, planned data-parallel."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from chipset.cli.main import main
from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.layout import TrainSpec
from chipset.planner.module import profile_module, search_module

DEV = DeviceProperties(name="module-test", index=0, total_memory=16 * 2**30, peak_flops={"bfloat16": 100e12},
                       memory_bandwidth=1e12, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)


def make_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def make_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 32 * 32, 10))


def test_counts_parameters_and_three_forward_passes_of_an_mlp():
    prof = profile_module("test_planner_module:make_mlp", (64,))
    assert prof.params == 64 * 256 + 256 + 256 * 10 + 10
    fwd = 2 * (64 * 256 + 256 * 10)
    assert prof.forward_flops_per_sample == fwd
    # backward: weight grads of both layers, input grad of the second only (the data needs none)
    assert prof.train_flops_per_sample == fwd + 2 * (64 * 256 + 256 * 10) + 2 * 256 * 10
    # saved for backward: the input (64) and the ReLU output (256), fp32, parameters excluded
    assert prof.activation_bytes_per_sample == 4 * (64 + 256)


def test_cnn_plan_reports_gradient_volume_by_zero_stage():
    prof = profile_module("test_planner_module:make_cnn", (3, 32, 32))
    assert prof.params == 3 * 16 * 9 + 16 + 16 * 32 * 32 * 10 + 10
    res = search_module(prof, TrainSpec(global_batch=64), Cluster(2, 8, DEV))
    by_zero = {p.layout.zero: p for p in res.candidates if p.layout.micro_batch == 4}
    grad_bytes = 2 * prof.params
    assert by_zero[0].comm[0].op == "all_reduce"
    assert by_zero[0].comm[0].bytes == pytest.approx(2 * 15 / 16 * grad_bytes)
    assert [p.step_time_s for p in res.candidates] == sorted(p.step_time_s for p in res.candidates)
    slow = search_module(prof, TrainSpec(global_batch=64), Cluster(2, 8, dataclasses.replace(
        DEV, inter_node_bandwidth=1e8)))
    assert slow.candidates[0].step_time_s >= res.candidates[0].step_time_s


@pytest.mark.parametrize(("spec", "match"), [
    ("nocolon", "expected package.module:factory"),
    ("no_such_module_xyz:f", "cannot import"),
    ("test_planner_module:nope", "has no attribute"),
])
def test_bad_factory_specs_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        profile_module(spec, (4,))


def test_cli_module_json_and_errors(capsys, monkeypatch):
    import chipset.planner.cluster as cluster

    monkeypatch.setattr(cluster, "all_profiles", lambda: {"module-test": ("t", DEV)})
    rc = main(["plan", "--module", "test_planner_module:make_cnn", "--input-shape", "3,32,32",
               "--cluster", "1x8:module-test", "--global-batch", "64", "--json", "--top", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert len(data) == 2 and all(c["dp"] == 8 and c["tp"] == 1 for c in data)
    rc = main(["plan", "--module", "test_planner_module:make_cnn", "--cluster", "1x8:module-test"])
    assert rc == 2 and "--input-shape" in capsys.readouterr().err
    rc = main(["plan", "--module", "test_planner_module:make_cnn", "--input-shape", "3,32,32",
               "--cluster", "1x8:module-test", "--fix", "parallel.tp=2"])
    assert rc == 2 and "data-parallel only" in capsys.readouterr().err
