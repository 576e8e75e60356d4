"""Observability: generic per-op accounting in Collective._run, per-step metrics from every
rank gathered on rank 0, profiler traces with chipset's ranges, TensorBoard when installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chipset
import forked_cli
import testenv
from chipset.errors import ConfigError
from chipset.interfaces import Group
from chipset.train.config import parse_profile_steps, resolve_config


class _Work:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1

    def is_completed(self):
        return self.waited > 0


def _sim_collective():
    return chipset.backend("cpu_sim").collective


def test_collective_run_counts_calls_bytes_and_blocking_time_per_op_on_any_backend():
    col = _sim_collective()
    col.comm_stats.reset()
    g = Group((0,), None, "world")
    t = torch.ones(10, dtype=torch.float32)
    col._run("all_reduce", g, [t], lambda: None, False)
    col._run("all_reduce", g, [t, t], lambda: None, False)
    work = _Work()
    h = col._run("reduce_scatter", g, [torch.ones(4, dtype=torch.float16)], lambda: work, True)
    before = col.comm_stats.ops["reduce_scatter"].seconds
    h.wait()  # the backend's re-wrapped handle still reports its blocking time
    snap = col.comm_stats.snapshot()
    assert snap["all_reduce"][:2] == (2, 3 * 40)
    assert snap["reduce_scatter"][:2] == (1, 8)
    assert work.waited == 1 and col.comm_stats.ops["reduce_scatter"].seconds > before
    assert set(snap) == {"all_reduce", "reduce_scatter"}


def test_collectives_are_named_ranges_in_a_profiler_trace():
    col = _sim_collective()
    g = Group((0,), None, "world")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        col._run("all_gather", g, [torch.ones(2)], lambda: None, False)
    assert "chipset::all_gather" in {e.name for e in prof.events()}


@pytest.mark.parametrize("text, expect", [("", None), ("3", (3, 3)), ("2:5", (2, 5))])
def test_profile_steps_parse(text, expect):
    assert parse_profile_steps(text) == expect


@pytest.mark.parametrize("bad", ["0:2", "5:3", "a:b"])
def test_bad_profile_steps_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        resolve_config(None, [f'train.profile_steps="{bad}"'], world_size=1)


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run(
        [sys.executable, "-m", "chipset.cli.main", "train", "--run-dir", str(run_dir), "--set", "train.steps=3",
         "--set", "train.global_batch=4", *extra],
        capture_output=True, text=True, env=env, timeout=240,
    )


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    """One ZeRO-2 run on 2 cpu_sim ranks with step 2 profiled (shared with the report tests)."""
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    r = _train(run_dir, "--nproc", "2", "--set", "parallel.zero=2", "--profile-steps", "2:2")
    assert r.returncode == 0, r.stdout + r.stderr
    # library notes go through logging, each rank's lines prefixed with its rank (chipset/logs.py)
    assert "[rank 0] INFO chipset.train.metrics: profiler trace of steps 2:2 per rank in" in r.stderr
    return run_dir


def test_every_step_record_has_every_ranks_time_memory_and_communication(two_rank_run):
    recs = [json.loads(line) for line in (two_rank_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        # the keys part 1 wrote are still there
        assert {"loss", "grad_norm", "lr", "loss_scale", "tokens_per_s", "step_time_s", "peak_memory_bytes"} <= set(r)
        assert 0 < r["mfu"] < 1
        for key in ("memory_bytes", "peak_memory_bytes_per_rank", "compute_s", "comm_s", "idle_s",
                    "step_time_s_per_rank"):
            assert len(r[key]) == 2, key
        assert all(p >= m > 0 for p, m in zip(r["peak_memory_bytes_per_rank"], r["memory_bytes"], strict=True))
        for i in range(2):
            parts = r["compute_s"][i] + r["comm_s"][i] + r["idle_s"][i]
            assert parts == pytest.approx(r["step_time_s_per_rank"][i], rel=1e-9)
            assert min(r["compute_s"][i], r["comm_s"][i], r["idle_s"][i]) >= 0
        assert r["slowest_rank"] in (0, 1) and r["idle_s"][r["slowest_rank"]] == 0
        assert all(0 < w < c for w, c in zip(r["data_wait_s"], r["compute_s"], strict=True)), "batches: part of compute"
        # ZeRO-2: gradients reduce-scattered, parameters all-gathered, grad norm + loss all-reduced
        assert {"reduce_scatter", "all_gather", "all_reduce"} <= set(r["comm"])
        assert r["comm"]["all_reduce"]["calls"] == [2, 2]
        rs = r["comm"]["reduce_scatter"]["bytes"]
        assert rs[0] == rs[1] > 0
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert summary["devices"]["peak_flops"]["float32"] > 0
    assert summary["comm_totals"]["reduce_scatter"]["bytes"] == 3 * sum(recs[0]["comm"]["reduce_scatter"]["bytes"])


def test_profile_steps_write_a_chrome_trace_per_rank_with_chipset_ranges(two_rank_run):
    for rank in (0, 1):
        trace = json.loads((two_rank_run / "traces" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"chipset::forward", "chipset::backward", "chipset::optimizer", "chipset::reduce_scatter",
                "chipset::all_gather", "chipset::all_reduce"} <= names
        # one all_gather per step from ZeRO-2's parameter update; the metrics gather is outside the trace
        assert sum(e.get("name") == "chipset::all_gather" and e.get("ph") == "X" for e in trace["traceEvents"]) == 1


def test_tensorboard_event_files_when_installed_else_a_note(tmp_path):
    run_dir = tmp_path / "run"
    r = _train(run_dir, "--set", "train.steps=2", "--profile-steps", "5:6")
    assert r.returncode == 0, r.stderr
    # profile steps past the end are reported, not silently ignored
    assert "no profiler trace: profile_steps 5:6 starts after the run's last step (2)" in r.stderr
    assert not (run_dir / "traces").exists()
    try:
        import torch.utils.tensorboard  # noqa: F401
    except Exception:
        assert "TensorBoard event files not written (pip install 'chipset[tensorboard]'" in r.stderr
        pytest.skip("tensorboard is not installed: checked the note instead of the event files")
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0

