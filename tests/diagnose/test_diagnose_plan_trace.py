"""chipset diagnose's planned-step check and trace findings on hand-made records and traces, whose
numbers are worked out in the docstrings."""

from __future__ import annotations

import json

import pytest

from chipset.diagnose.planned import SLOWER, plan_check
from chipset.diagnose.trace import HOST_SHARE, trace_check


def _recs(compute, comm, n=6):
    """2 ranks, every step ``compute`` s outside collectives and ``comm`` s in all_reduce."""
    return [{"step": s, "compute_s": [compute] * 2, "comm_s": [comm] * 2, "idle_s": [0.0] * 2,
             "data_wait_s": [0.0] * 2, "step_time_s_per_rank": [compute + comm] * 2,
             "comm": {"all_reduce": {"calls": [1, 1], "bytes": [8, 8], "seconds": [comm] * 2}}}
            for s in range(1, n + 1)]


def _summary(estimated):
    """Planned: compute 0.3 + optimizer 0.05 + host 0.05 = 0.4 s, the all-reduce (dp and tp) 0.1 s."""
    return {"devices": {"name": "dev", "estimated": estimated},
            "projection": {"profile": "dev", "step_time_s": 0.5, "compute_s": 0.3, "optimizer_s": 0.05,
                           "host_s": 0.05, "bubble_s": 0.0,
                           "comm_ops": {"all_reduce": {"seconds": 0.2, "dims": ["tp", "dp"], "exposed_s": 0.1}}}}


def test_absolute_mode_blames_compute_on_the_profiled_device(tmp_path):
    """On the device itself (estimated false): 1.9 + 0.1 = 2.0 s against 0.5 s planned is 4x, the
    gap in compute (1.5 s); 1.8 + 0.1 = 1.9 s would be 3.8x: no finding."""
    found = plan_check(tmp_path, _recs(1.9, 0.1), _summary(False))[0]
    assert [f["evidence"]["term"] for f in found] == ["compute"]
    ev = found[0]["evidence"]
    assert ev["ratio"] == pytest.approx(2.0 / 0.5) and ev["gap_s"]["compute"] == pytest.approx(1.5)
    assert SLOWER == 4.0 and plan_check(tmp_path, _recs(1.8, 0.1), _summary(False))[0] == []


def test_ratio_mode_scales_the_plan_to_the_measured_compute(tmp_path):
    """Estimated rates (a simulator): k = 1.9 / 0.4, planned 0.5 k = 2.375 s, and 2.0 s is no finding.
    With 9 s in the all-reduce: 10.9 s over 2.375 s is 4.6x, the gap in 'dp+tp' (the record cannot
    split the all-reduce between the two groups that issue it): 9 - 0.1 k = 8.525 s."""
    assert plan_check(tmp_path, _recs(1.9, 0.1), _summary(True))[0] == []
    found = plan_check(tmp_path, _recs(1.9, 9.0), _summary(True))[0]
    ev = found[0]["evidence"]
    assert ev["term"] == "dp+tp" and ev["scale"] == pytest.approx(1.9 / 0.4)
    assert ev["gap_s"] == pytest.approx({"data": 0.0, "dp+tp": 9.0 - 0.1 * 1.9 / 0.4, "idle": 0.0})
    assert ev["ratio"] == pytest.approx(10.9 / (0.5 * 1.9 / 0.4))


def test_no_projection_and_no_config_is_a_note(tmp_path):
    found, missing, notes = plan_check(tmp_path, _recs(1.0, 0.1), {"devices": {"name": "dev"}, "world_size": 2})
    assert found == [] and missing == [] and "no planner projection" in notes[0]


def _x(name, ts_ms, dur_ms, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "tid": tid}


def _trace(run_dir, rank, events):
    (run_dir / "traces").mkdir(exist_ok=True)
    (run_dir / "traces" / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))


def _step(gap_ms):
    """A 9 + ``gap_ms`` ms step: a 6 ms forward with a 2 ms and a 1.5 ms operator (a 1 ms one nested in
    it: its self time is 0.5 ms), a 1 ms optimizer range, an all-reduce range of 1 ms at 8 ms + gap;
    inside nothing: 9 - 2 - 1.5 - 1 = 4.5 ms + gap."""
    g = gap_ms
    return [_x("chipset::step", 0, 9 + g, "user_annotation"), _x("chipset::forward", 0, 6, "user_annotation"), _x("aten::mm", 0, 2), _x("aten::_foreach_add_", 3, 1.5),
            _x("aten::add", 3.2, 1), _x("chipset::all_reduce", 8 + g, 1, "user_annotation"),
            _x("chipset::optimizer", 6, 1, "user_annotation")]


def test_host_overhead_is_the_step_outside_operators_and_collectives(tmp_path):
    """gap share (4.5 + g) / (9 + g): 0.609 at g = 2.5 and 0.654 at g = 4 (over the 0.6 limit), 0.598
    at g = 2.2 (under it); a finding when at least half the spans are over."""
    _trace(tmp_path, 0, _step(2.5))
    _trace(tmp_path, 1, _step(4))
    found = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cuda"})[0]}
    ev = found["host_overhead"]["evidence"]
    assert ev["ranks_over"] == [0, 1] and ev["gap_s"] == pytest.approx((7.0 + 8.5) / 1e3)
    assert ev["gap_share"] == pytest.approx(15.5 / 24.5) and HOST_SHARE == 0.6 and found["host_overhead"]["rank"] == 1
    _trace(tmp_path, 0, _step(2.2))
    ev = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cuda"})[0]}["host_overhead"]["evidence"]
    assert ev["ranks_over"] == [1] and ev["over_spans"] == 1
    _trace(tmp_path, 1, _step(0))
    assert "host_overhead" not in {f["kind"] for f in trace_check(tmp_path, {"backend": "cuda"})[0]}


def test_a_pipeline_stages_trace_counts_its_operators(tmp_path):
    """Under pp the loop's forward ranges are ``chipset::stage<N>.forward``: their thread's operators
    count as in a dp trace (the same gaps and top operators). Until 2026-12-07 only ``chipset::forward``
    named that thread, so a host backend's pp run had no operators: every profiled step was "host
    overhead" (78% on a cpu run at hidden 512 whose steps were matrix products) and no top operators."""

    def stage(gap_ms, n):
        return [{**e, "name": f"chipset::stage{n}.forward"} if e["name"] == "chipset::forward" else e
                for e in _step(gap_ms)]

    _trace(tmp_path, 0, stage(0, 0))
    _trace(tmp_path, 1, stage(0, 1))
    found = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cpu"})[0]}
    assert "host_overhead" not in found
    assert [r["operator"] for r in found["top_operators"]["evidence"]["operators"]] == [
        "aten::mm", "aten::add", "aten::_foreach_add_"]
    _trace(tmp_path, 0, stage(2.5, 0))
    _trace(tmp_path, 1, stage(4, 1))
    ev = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cpu"})[0]}["host_overhead"]["evidence"]
    assert ev["gap_s"] == pytest.approx((7.0 + 8.5) / 1e3)


def test_a_collective_inside_an_operator_is_not_its_self_time(tmp_path):
    """Tensor parallelism's autograd function around its all-reduce (``_ReduceFromGroup``, 5 ms, 3.5 ms
    of it chipset's ``all_reduce`` range): 1.5 ms of its own. Until 2026-12-07 the wait counted, and such
    wrappers led a tp=2 cpu run's operators (64% of self time; cp's gather 71%)."""
    _trace(tmp_path, 0, [*_step(0), _x("_ReduceFromGroup", 10, 5), _x("chipset::all_reduce", 11, 3.5, "user_annotation")])
    rows = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cpu"})[0]}["top_operators"]["evidence"]["operators"]
    assert [(r["operator"], r["self_s"]) for r in rows] == [
        ("aten::mm", 0.002), ("_ReduceFromGroup", 0.0015), ("aten::add", 0.001), ("aten::_foreach_add_", 0.0005)]


def test_top_operators_by_self_time_and_the_backends_kernels(tmp_path):
    """Self time over both ranks: mm 4 ms, _foreach_add_ 2 x 0.5 = 1 ms, add 2 ms. The cuda plugin
    declares fused_adamw and no linear (declared kernels need no GPU to read); cpu_sim registers none."""
    _trace(tmp_path, 0, _step(0))
    _trace(tmp_path, 1, _step(0))
    rows = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cuda"})[0]}["top_operators"]["evidence"]["operators"]
    assert [(r["operator"], r["self_s"], r["kernel"]) for r in rows] == [
        ("aten::mm", 0.004, "linear"), ("aten::add", 0.002, None), ("aten::_foreach_add_", 0.001, "fused_adamw")]
    assert rows[2]["faster_kernel"] == "cuda registers fused_adamw" and rows[0]["faster_kernel"].startswith("no faster linear")
    # A receive waiting 5 ms for its peer (a pipeline stage's) is no operator to write a kernel for.
    _trace(tmp_path, 1, [*_step(0), _x("c10d::recv_", 9, 5)])
    rows = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cuda"})[0]}["top_operators"]["evidence"]["operators"]
    assert [r["operator"] for r in rows] == ["aten::mm", "aten::add", "aten::_foreach_add_"]
    assert rows[0]["share"] == pytest.approx(4 / 7, abs=5e-5)  # shares are rounded to 4 places
    sim = {f["kind"]: f for f in trace_check(tmp_path, {"backend": "cpu_sim"})[0]}["top_operators"]["evidence"]
    assert sim["operators"][2]["faster_kernel"].startswith("no faster fused_adamw on cpu_sim (registered by ")
