"""``chipset train --project PROFILE``: the run's work projected onto a named device profile.

One short dp2 run on cpu_sim through the CLI; the projection in summary.json is checked
against the planner's own pieces and against the bytes the simulator counted.
"""

from __future__ import annotations

import json
import sys

import pytest

import forked_cli
import testenv
from chipset.planner.cluster import Cluster
from chipset.planner.comm import ring_bytes
from chipset.planner.projection import format_mfu, format_projection, project, resolve_profile
from chipset.planner.run import from_run_config
from chipset.planner.time import evaluate
from chipset.train.config import load_config

SETS = ["--set", "train.steps=2", "--set", "train.global_batch=8", "--set", "train.seq_len=32",
        "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128"]


def _cli(*args: str, timeout: float = 300):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_unknown_profile_exits_2_listing_the_known_ones_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = _cli("train", "--run-dir", str(run_dir), "--project", "h900-imaginary", *SETS)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--project 'h900-imaginary': unknown device profile" in r.stderr
    assert "h100-sxm" in r.stderr and "a100-80g" in r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_a_profile_without_a_peak_for_the_dtype_is_refused():
    from chipset.errors import ConfigError

    # Ascend 910B rates half precision only: a float32 run cannot be projected onto it.
    with pytest.raises(ConfigError, match="declares no peak FLOP/s for train.dtype 'float32'"):
        resolve_profile("910b", "float32")
    assert resolve_profile("910b", "bfloat16").peak_flops_for("bfloat16") > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("project") / "run"
    r = _cli("train", "--nproc", "2", "--run-dir", str(run_dir), "--project", "h100-sxm", *SETS)
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir, r.stdout


def test_projection_is_reported_and_written_to_the_summary(run):
    run_dir, out = run
    p = json.loads((run_dir / "summary.json").read_text())["projection"]
    assert p["profile"] == "h100-sxm" and p["devices"] == 2 and p["dtype"] == "float32"
    line = [x for x in out.splitlines() if x.startswith("chipset train: projected on 2 x h100-sxm")]
    assert len(line) == 1, out
    assert "measured here on cpu_sim" in line[0] and f"MFU {format_mfu(p['mfu'])}" in line[0]
    assert "MFU 0.0%" not in line[0]  # a tiny model's MFU keeps its digits
    assert "; measured here on cpu: 0.1 s/step" in format_projection(p, 0.1, 100.0, backend="cpu"), \
        "the line names the backend the run was measured on, not always cpu_sim"
    assert p["compute_s"] > 0 and p["comm_s"] > 0
    assert p["step_time_s"] >= p["compute_s"] + p["optimizer_s"] + p["host_s"]
    # issue 20: this model's kernels run for microseconds; the step still pays each launch and the host
    assert p["roofline_s"] < p["launch_floor_s"] == pytest.approx(p["compute_s"])
    assert p["host_s"] > 0
    assert p["comm_exposed_s"] <= p["comm_s"]
    tokens = 8 * 32
    assert p["tokens_per_s"] == pytest.approx(tokens / p["step_time_s"])
    assert 0 < p["mfu"] < 1


def test_projection_uses_the_planners_compute_and_the_counted_bytes(run):
    """Compute equals the planner's evaluate() on the profile; communication time is rebuilt from the
    simulator's counted all-reduce bytes with the ring volume 2(n-1)/n and the profile's bandwidth."""
    run_dir, _ = run
    cfg = load_config(run_dir / "config.toml")
    p = json.loads((run_dir / "summary.json").read_text())["projection"]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    dev = resolve_profile("h100-sxm", "float32")
    m, lay, train = from_run_config(cfg, 2, kernels="fused")
    want = evaluate(m, lay, train, Cluster(1, 2, dev, "h100-sxm"), seq_len=cfg.train.seq_len)
    assert p["compute_s"] == pytest.approx(want.breakdown["compute"])
    ar = last["comm"]["all_reduce"]
    assert min(ar["bytes"]) >= 4 * m.num_params()  # every float32 gradient really travelled
    calls, nbytes = ar["calls"][0], ar["bytes"][0]
    expect = calls * 2 * dev.intra_node_latency + ring_bytes("all_reduce", nbytes, 2) / dev.intra_node_bandwidth
    assert p["comm_s"] == pytest.approx(expect, rel=1e-6)


def test_a_faster_device_projects_a_shorter_step(run):
    """Faster kernels and links; but this tiny model is launch-bound (the floor and host overhead
    are the same on both), so its step is no longer shorter, only never longer."""
    run_dir, _ = run
    cfg = load_config(run_dir / "config.toml")
    comm = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["comm"]
    slow, fast = project(cfg, 2, comm, "a100-80g"), project(cfg, 2, comm, "b200")
    assert fast["step_time_s"] <= slow["step_time_s"]
    assert fast["roofline_s"] < slow["roofline_s"] and fast["comm_s"] < slow["comm_s"]
    assert fast["compute_s"] >= fast["launch_floor_s"]


def test_mfu_keeps_two_significant_digits_when_it_is_tiny():
    assert format_mfu(0.4213) == "42.1%" and format_mfu(0.001) == "0.1%"
    assert format_mfu(0.00016120186940644452) == "0.016%" and format_mfu(0.0) == "0%"
