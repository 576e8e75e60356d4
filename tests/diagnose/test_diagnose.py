"""chipset diagnose: the finding rules on synthetic metrics records, and the CLI on run folders."""

from __future__ import annotations

import json

import pytest

from chipset.cli.main import main
from chipset.diagnose import diagnose_records

MIB = 1024 * 1024


def _recs(n=8, world=2, **over):
    """Clean steady records; ``over[key](step, rank_or_None)`` changes one field."""
    out = []
    for s in range(1, n + 1):
        rec = {"step": s, "loss": 5.0 - 0.1 * s, "grad_norm": 1.0, "skipped": False, "step_time_s": 1.0,
               "compute_s": [0.8] * world, "comm_s": [0.1] * world, "idle_s": [0.1] * world,
               "memory_bytes": [100 * MIB] * world, "peak_memory_bytes_per_rank": [200 * MIB] * world,
               "comm": {"all_reduce": {"calls": [1] * world, "bytes": [4096] * world, "seconds": [0.1] * world}}}
        for key, fn in over.items():
            rec[key] = fn(s, rec.get(key))
        out.append(rec)
    return out


SUMMARY = {"devices": {"total_memory_bytes": 1024 * MIB}, "layout": {"dp": 2}}


def _first(recs):
    d = diagnose_records(recs, SUMMARY)
    return d, d.findings[0] if d.findings else None


def test_clean_run_has_no_finding():
    d, first = _first(_recs())
    assert first is None and not d.has_error


def test_straggler_names_the_rank_and_first_step():
    d, f = _first(_recs(compute_s=lambda s, v: [0.8, 1.6] if s >= 3 else v))
    assert (f.kind, f.rank, f.step, f.severity) == ("straggler", 1, 3, "error")
    assert f.evidence["cause"] == "device (compute)"


def test_straggler_blamed_on_input_when_its_data_wait_explains_it():
    d, f = _first(_recs(compute_s=lambda s, v: [0.8, 1.6], data_wait_s=lambda s, v: [0.0, 0.7],
                        **{"step_time_s": lambda s, v: 10.0}))
    assert f.kind == "straggler" and f.evidence["cause"] == "input pipeline"


def test_straggler_whose_thread_waited_for_a_host_cpu_is_a_warning_not_a_slow_device():
    # The same slow rank as above: its excess compute is its wait for a CPU (cpu_wait_s), so the
    # host is busy, not the device; with the wait not explaining it, the device is blamed.
    d, f = _first(_recs(compute_s=lambda s, v: [0.8, 1.6], cpu_wait_s=lambda s, v: [0.01, 0.6]))
    assert (f.kind, f.rank, f.severity, f.evidence["cause"]) == ("straggler", 1, "warning", "host CPU contention")
    assert "host CPU" in f.advice and not d.has_error
    d, f = _first(_recs(compute_s=lambda s, v: [0.8, 1.6], cpu_wait_s=lambda s, v: [0.01, 0.3]))
    assert (f.severity, f.evidence["cause"]) == ("error", "device (compute)")


def test_a_slightly_slower_rank_is_not_a_straggler():
    d, _ = _first(_recs(compute_s=lambda s, v: [0.8, 0.9]))
    assert not d.findings


def _pp(recs, **layout):
    return diagnose_records(recs, {**SUMMARY, "layout": {"dp": 1, "tp": 1, "pp": 2, **layout}})


def test_pipeline_stages_are_compared_as_stages_not_as_stragglers():
    """Rank order (pp slowest): with pp=2 dp=2, ranks 0-1 are stage 0 and ranks 2-3 stage 1."""
    d = _pp(_recs(compute_s=lambda s, v: [0.8, 1.6]))  # pp=2 on 2 ranks: the last stage works more
    assert [(f.kind, f.rank, f.evidence["stage"], f.severity) for f in d.findings] == [
        ("stage_imbalance", 1, 1, "warning")]
    d = _pp(_recs(world=4, compute_s=lambda s, v: [0.8, 0.8, 1.6, 1.6]), dp=2)
    assert [(f.kind, f.evidence["ranks"]) for f in d.findings] == [("stage_imbalance", [2, 3])]
    # Rank 3 is a straggler against rank 2 alone (not against stage 0's slower ranks), and stage 0
    # (its fastest rank) is the slower stage.
    d = _pp(_recs(world=4, compute_s=lambda s, v: [1.6, 1.6, 0.8, 1.6]), dp=2)
    assert [(f.kind, f.rank, f.severity) for f in d.findings] == [("straggler", 3, "error"),
                                                                   ("stage_imbalance", 0, "warning")]


def _pipe(p2p, compute=(0.8, 0.8), m=4, v=1, **pipeline):
    """pp=2 on 2 ranks: each rank blocked ``p2p[r]`` s in batch_p2p (its wait for the other stage)
    on top of ``compute[r]`` s of work, every step."""
    recs = _recs(compute_s=lambda s, _: list(compute), comm_s=lambda s, _: list(p2p), idle_s=lambda s, _: [0.0, 0.0],
                 comm=lambda s, _: {"batch_p2p": {"calls": [8, 8], "bytes": [4096] * 2, "seconds": list(p2p)}},
                 step_time_s=lambda s, _: max(c + w for c, w in zip(compute, p2p, strict=True)))
    lay = {"dp": 1, "tp": 1, "pp": 2}
    return diagnose_records(recs, {**SUMMARY, "layout": lay,
                                   "pipeline": {"schedule": "1f1b", "micro_batches": m, "virtual_stages": v, **pipeline}})


def test_a_pipeline_bubble_above_the_schedules_theory():
    """pp=2, m=4: theory (p-1)/m = 0.25 of the busy time; a step is over when busy + wait >= 1.25x
    busy x (1 + 0.25), i.e. a measured bubble >= 0.5625."""
    assert not [f for f in _pipe([0.2, 0.2]).findings if f.kind == "pipeline_bubble"]  # 0.2 / 0.8: the theory
    assert not _pipe([0.44, 0.44]).findings  # 0.55: inside the margin
    d = _pipe([0.6, 0.5])  # 0.75 and 0.625: the rank that waited least is measured
    f = d.findings[0]
    assert (f.kind, f.severity, f.step, f.rank) == ("pipeline_bubble", "warning", 2, None)
    assert f.evidence["theory_bubble"] == 0.25 and f.evidence["measured_bubble"] == pytest.approx(0.625)
    assert f.evidence["excess_wait_s_per_step"] == pytest.approx(0.5 - 0.25 * 0.8)
    assert "micro_batches" not in f.advice  # theory 25%: at the margin, not over it
    # Interleaved, v=2: theory 1/8, so the same 0.55 is over (limit 1.25 x 1.125 - 1 = 0.40625).
    assert [f.kind for f in _pipe([0.44, 0.44], v=2, schedule="interleaved_1f1b").findings] == ["pipeline_bubble"]
    # m=1: theory 100%; a bubble of 1.6 is over it, and the advice asks for micro-batches.
    assert "parallel.micro_batches" in _pipe([1.3, 1.3], m=1).findings[0].advice


def test_an_unbalanced_pipeline_is_a_stage_imbalance_not_a_bubble():
    """Stage 0 waits for the slower stage 1 (1.0 s on 0.8 s of work); stage 1 waits 0.2 s on 1.6 s."""
    d = _pipe([1.0, 0.2], compute=(0.8, 1.6))
    assert [f.kind for f in d.findings] == ["stage_imbalance"]


def test_a_pipeline_run_without_its_schedule_says_so():
    recs = _recs(comm=lambda s, _: {"batch_p2p": {"calls": [8, 8], "bytes": [4096] * 2, "seconds": [0.1, 0.1]}})
    d = diagnose_records(recs, {**SUMMARY, "layout": {"pp": 2}})
    assert any("pipeline.micro_batches" in m for m in d.missing)
    assert not any("pipeline" in m for m in diagnose_records(recs, SUMMARY).missing)  # pp=1: no check


def test_leak_rate_rank_and_first_step():
    d, f = _first(_recs(memory_bytes=lambda s, v: [100 * MIB, 100 * MIB + (max(0, s - 2) * 4 * MIB)]))
    assert (f.kind, f.rank, f.step) == ("memory_leak", 1, 3)
    assert f.evidence["mib_per_step"] == 4.0  # steady steps 2..8: 0 -> 24 MiB over 6 steps


def test_profiled_steps_are_not_read_as_a_leak_and_a_leak_before_them_still_is():
    # The profiler's buffers grow memory at every step from the first profiled one (step 6) on.
    profiler = _recs(n=30, memory_bytes=lambda s, v: [100 * MIB + max(0, s - 5) * 30 * MIB] * 2)
    assert [f.kind for f in diagnose_records(profiler, SUMMARY).findings] == ["memory_leak"] * 2
    d = diagnose_records(profiler, {**SUMMARY, "profiled_steps": [6, 30]})
    assert d.findings == []
    leak = _recs(n=30, memory_bytes=lambda s, v: [100 * MIB, 100 * MIB + s * 4 * MIB])
    d = diagnose_records(leak, {**SUMMARY, "profiled_steps": [6, 30]})
    assert [(f.kind, f.rank) for f in d.findings] == [("memory_leak", 1)]  # read on steps 2-5
    short = diagnose_records(leak, {**SUMMARY, "profiled_steps": [4, 5]})
    assert short.findings == [] and any("before the first profiled step (4)" in m for m in short.missing)


def test_near_capacity():
    d, f = _first(_recs(peak_memory_bytes_per_rank=lambda s, v: [200 * MIB, 1010 * MIB] if s == 5 else v))
    assert (f.kind, f.rank, f.step, f.severity) == ("memory_near_capacity", 1, 5, "error")


def test_loss_spike_and_grad_explosion_and_skips():
    d, f = _first(_recs(loss=lambda s, v: 40.0 if s == 6 else v))
    assert (f.kind, f.step) == ("loss_spike", 6)
    d, f = _first(_recs(grad_norm=lambda s, v: 500.0 if s == 4 else v))
    assert (f.kind, f.step) == ("grad_norm_explosion", 4)
    d, f = _first(_recs(skipped=lambda s, v: s in (2, 3, 4)))
    assert (f.kind, f.step, f.severity) == ("skipped_steps", 2, "error")


def test_data_loader_stall():
    d, f = _first(_recs(data_wait_s=lambda s, v: [0.6, 0.6]))
    assert f.kind == "data_loader_stall" and f.severity == "error"


def test_data_wait_is_read_against_the_waiting_ranks_own_step():
    # Rank 1 waits 0.15 s for its batches in a 1.0 s step (15%, under the 20% stall mark); rank 0's
    # step, started late, is 0.5 s: against it the same wait read as 30%, a stall.
    recs = _recs(data_wait_s=lambda s, v: [0.0, 0.15], step_time_s=lambda s, v: 0.5,
                 step_time_s_per_rank=lambda s, v: [0.5, 1.0])
    assert not [f for f in diagnose_records(recs, SUMMARY).findings if f.kind == "data_loader_stall"]
    d, f = _first(_recs(data_wait_s=lambda s, v: [0.0, 0.3], step_time_s_per_rank=lambda s, v: [1.0, 1.0]))
    assert (f.kind, f.rank) == ("data_loader_stall", 1)


def test_communication_bound_names_the_collective():
    d, f = _first(_recs(comm_s=lambda s, v: [0.8, 0.8], compute_s=lambda s, v: [0.1, 0.1]))
    assert f.kind == "communication_bound" and f.evidence["top_collective"] == "all_reduce"


def test_a_rank_waiting_for_a_late_peer_is_not_read_against_rank_0s_shorter_step():
    # The clean 2-rank run of a CI failure (3 test workers on 2 cores): in one step rank 0 started
    # late, rank 1 waited 0.59 s in the first all-reduce, so its step took 0.61 s to rank 0's
    # 0.022 s. Against rank 0's time that step read as 13x and the run as 312% communication.
    comm = {2: [0.023, 0.023], 3: [0.009, 0.005], 4: [0.0, 0.588], 5: [0.043, 0.043], 6: [0.006, 0.016]}
    own = {2: [0.035, 0.036], 3: [0.026, 0.022], 4: [0.022, 0.613], 5: [0.057, 0.056], 6: [0.03, 0.04]}
    recs = _recs(n=6, comm_s=lambda s, v: comm.get(s, [0.003, 0.182]),
                 step_time_s_per_rank=lambda s, v: own.get(s, [0.069, 0.248]),
                 step_time_s=lambda s, v: own.get(s, [0.069, 0.248])[0])
    d, f = _first(recs)
    assert not [x for x in d.findings if x.kind == "communication_bound"], d.findings
    # Half the steps at 90% of every rank's own step time is still communication-bound, an error.
    d, f = _first(_recs(comm_s=lambda s, v: [0.9, 1.8], step_time_s_per_rank=lambda s, v: [1.0, 2.0]))
    assert (f.kind, f.severity) == ("communication_bound", "error") and f.evidence["mean_comm_share"] == pytest.approx(0.9)


def test_findings_are_ranked_errors_first():
    d, f = _first(_recs(loss=lambda s, v: 8.0 if s == 6 else v,  # a mild spike (1.8x): warning
                        memory_bytes=lambda s, v: [100 * MIB + s * 2 * MIB, 100 * MIB]))
    assert [x.kind for x in d.findings] == ["memory_leak", "loss_spike"]


# --- the command ---------------------------------------------------------------------
def _write(tmp_path, recs, summary=SUMMARY, torn=False):
    lines = [json.dumps(r) for r in recs] + (['{"step": 9, "lo'] if torn else [])
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_cli_json_and_exit_status(tmp_path, capsys):
    run = _write(tmp_path, _recs(compute_s=lambda s, v: [2.0, 0.8]))
    assert main(["diagnose", str(run), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0]["kind"] == "straggler" and out["findings"][0]["rank"] == 0
    assert out["has_error"] and out["missing"] == ["config.toml not found: no layout check against 'chipset plan'"]


def test_cli_clean_run_exits_0(tmp_path, capsys):
    assert main(["diagnose", str(_write(tmp_path, _recs()))]) == 0
    assert "no findings" in capsys.readouterr().out


def test_partial_run_dir_says_what_was_missing(tmp_path, capsys):
    run = _write(tmp_path, _recs(), summary=None, torn=True)
    assert main(["diagnose", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partial"] and any("summary.json not found" in m for m in out["missing"])
    assert any("line 9 is not JSON" in m for m in out["missing"])


def test_unreadable_run_dir_exits_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    (tmp_path / "summary.json").write_text("{cut")
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "nothing to diagnose" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "nope")]) == 2


def test_an_empty_folder_or_a_file_exits_2_saying_what_was_expected(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to diagnose: expected metrics.jsonl step records or summary.json" in err
    assert "metrics.jsonl not found" in err and "summary.json not found" in err
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert main(["diagnose", str(tmp_path / "metrics.jsonl")]) == 2
    assert "a file, not a folder" in capsys.readouterr().err


def test_summary_only_is_a_partial_diagnosis(tmp_path, capsys):
    run = _write(tmp_path, [], summary={**SUMMARY, "world_size": 2})
    (run / "metrics.jsonl").unlink()
    assert main(["diagnose", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partial"] and out["missing"][0] == "metrics.jsonl not found: no per-step findings"


def test_a_summary_of_another_shape_is_ignored(tmp_path, capsys):
    run = _write(tmp_path, _recs(), summary=[1, 2])
    assert main(["diagnose", str(run), "--json"]) == 0
    assert "summary.json is not a JSON object; ignored" in json.loads(capsys.readouterr().out)["missing"]


def test_unreadable_fields_are_left_out_of_their_steps_and_named():
    """A short per-rank list (a rank's numbers lost), a string, a null: only those steps lose the
    field; the straggler is still found from the other steps."""
    bad = {3: [0.8], 4: [0.8, "x"], 5: None}
    d = diagnose_records(_recs(compute_s=lambda s, v: bad.get(s, [0.8, 1.6])))
    assert (d.findings[0].kind, d.findings[0].rank) == ("straggler", 1)
    assert d.findings[0].evidence["slow_steps"] == [2, 6, 7, 8]
    assert "metrics.jsonl: compute_s is not 2 finite numbers (one per rank) in 3 step(s) (3, 4, 5); left out there" \
        in d.missing


def test_a_restarted_run_keeps_the_later_record_of_a_step():
    # The first attempt's step 6 spiked (and the run died); resumed from step 4, it ran 5-8 again.
    recs = _recs(n=6, loss=lambda s, v: 40.0 if s == 6 else v) + _recs(n=8)[4:]
    d = diagnose_records(recs, SUMMARY)
    assert d.steps == 8 and not d.findings
    assert d.missing == ["metrics.jsonl records 2 step(s) more than once (a restart resumed from a checkpoint?): "
                         "the later record of each kept"]


def test_a_nan_loss_written_as_null_is_a_loss_spike():
    """metrics.jsonl writes NaN/inf as null; a null gradient norm of a skipped fp16 step is not one."""
    d = diagnose_records(_recs(loss=lambda s, v: None if s == 5 else v,
                               grad_norm=lambda s, v: None if s == 3 else v, skipped=lambda s, v: s == 3))
    assert (d.findings[0].kind, d.findings[0].step, d.findings[0].severity) == ("loss_spike", 5, "error")
    assert d.findings[0].evidence["value"] == "nan"
    assert "grad_norm_explosion" not in [f.kind for f in d.findings]


def test_report_page_starts_with_the_findings(tmp_path):
    from chipset.report import load_run, render_html

    html = render_html(load_run(_write(tmp_path, _recs(compute_s=lambda s, v: [2.0, 0.8]))))
    assert html.index("<h2>Findings</h2>") < html.index("<h2>Run</h2>")
    assert "rank 0 is a straggler" in html


def test_live_watch_warns_once_per_straggler_and_leak():
    from chipset.train.watch import LiveWatch

    watch, lines = LiveWatch(), []
    for rec in _recs(compute_s=lambda s, v: [0.8, 1.6], memory_bytes=lambda s, v: [100 * MIB, s * MIB]):
        lines += watch.step(rec)
    assert len(lines) == 2 and "rank 1 is a straggler" in lines[0] and "rank 1's memory grew" in lines[1]
    # the first step (warm-up) is not counted: slow in steps 2-4, memory grown into steps 3-5
    assert "(step 4)" in lines[0] and "at step 5" in lines[1] and "batches" not in lines[0]
    watch = LiveWatch()
    lines = [x for rec in _recs(compute_s=lambda s, v: [0.8, 1.6], data_wait_s=lambda s, v: [0.0, 0.7])
             for x in watch.step(rec)]
    assert lines and "0.7 s of it waiting for its batches (its input pipeline)" in lines[0]
    watch = LiveWatch()
    lines = [x for rec in _recs(compute_s=lambda s, v: [0.8, 1.6], cpu_wait_s=lambda s, v: [0.0, 0.7])
             for x in watch.step(rec)]
    assert lines and "0.7 s of it waiting for a host CPU" in lines[0]
    watch = LiveWatch(stages=[0, 1])  # pp=2: the last stage's longer compute is not a straggler
    assert not [x for rec in _recs(compute_s=lambda s, v: [0.8, 1.6]) for x in watch.step(rec)]
    watch = LiveWatch()
    assert not [x for rec in _recs() for x in watch.step(rec)]


def test_live_watch_reads_no_straggler_from_the_warm_up_or_profiled_steps():
    """A rank slower only in the first step and in profiled steps 4-5 (the profiler starting on it) is
    not named; a profiled step neither extends nor breaks a streak; without the profiled range it is."""
    from chipset.train.watch import LiveWatch

    slow = {1, 4, 5, 7}  # 2-3 fast between: no streak of 3 counted steps but through 4-5

    def feed(watch, slow_steps):
        return [x for rec in _recs(compute_s=lambda s, v: [0.8, 1.6] if s in slow_steps else v) for x in watch.step(rec)]

    assert not feed(LiveWatch(profiled=(4, 5)), slow)
    assert feed(LiveWatch(), {1, 2, 3}) == []  # step 1 is the warm-up: 2 of 3 counted
    lines = feed(LiveWatch(profiled=(4, 5)), {2, 3, 6})  # 2, 3, (4, 5 not counted), 6
    assert len(lines) == 1 and "(step 6)" in lines[0]
    assert feed(LiveWatch(), {4, 5, 6}) and not feed(LiveWatch(profiled=(4, 5)), {4, 5, 6})


def test_live_watch_reads_no_memory_growth_from_the_warm_up_or_profiled_steps():
    """The allocator warming up (rank 0 of a cpu-backend pp=2 run at size L grew into steps 2-4, then
    held: a live "leak" line at step 4 until 2026-12-07) and the profiler's buffers (profiled steps
    4-6) are not a leak; growth into steps 3-5, each read from a read step, is; a profiled step neither
    extends nor breaks the streak."""
    from chipset.train.watch import LiveWatch

    def feed(watch, grown):  # rank 1 gains 2 MiB in each step of ``grown``
        mem = lambda s, v: [100 * MIB, (100 + 2 * sum(k <= s for k in grown)) * MIB]  # noqa: E731
        return [x for rec in _recs(memory_bytes=mem) for x in watch.step(rec)]

    assert not feed(LiveWatch(), {2, 3, 4})
    assert not feed(LiveWatch(profiled=(4, 6)), {4, 5, 6, 7})  # 7 is read from profiled 6: not counted
    lines = feed(LiveWatch(), {3, 4, 5})
    assert len(lines) == 1 and "rank 1's memory grew" in lines[0] and "at step 5" in lines[0]
    lines = feed(LiveWatch(profiled=(4, 5)), {2, 3, 4, 5, 6, 7, 8})  # read: 3, (4, 5, 6 not), 7, 8
    assert len(lines) == 1 and "at step 8" in lines[0] and "3 steps in a row (the profiled steps not counted)" in lines[0]


def test_straggler_leaves_out_profiled_steps():
    """The CI run of 2026-12-07 in small: rank 1 slower in steady steps 2-3 by 1.44x and far slower in
    the first profiled step; with that step in, a 1.68x error ("device"), without it a warning."""
    compute = {2: [11.3, 19.0], 3: [15.7, 19.8], 4: [15.4, 61.4], 5: [26.0, 29.8], 6: [26.1, 28.6]}
    recs = _recs(n=6, compute_s=lambda s, v: [x / 1000 for x in compute[s]] if s in compute else v)
    f = diagnose_records(recs, SUMMARY).findings[0]
    assert (f.kind, f.severity, round(f.evidence["ratio"], 2)) == ("straggler", "error", 1.68)
    d = diagnose_records(recs, {**SUMMARY, "profiled_steps": [4, 6]})
    f = d.findings[0]
    assert (f.kind, f.severity, round(f.evidence["ratio"], 2), f.evidence["slow_steps"]) == ("straggler", "warning", 1.44, [2, 3])
    assert not d.has_error
    every = diagnose_records(recs, {**SUMMARY, "profiled_steps": [1, 6]}).findings[0]  # all profiled: all read
    assert (every.kind, every.severity) == ("straggler", "error")


def test_recompiles_that_go_on_after_warm_up_are_a_storm():
    """8 steps, warm-up 2: rank 0 compiles a frame in each of steps 4-8, 5 of the 6 later steps
    (>= half: a storm; < 90%: a warning). Compiling in steps 1-2 only, or in 2 of the 6, is not."""
    d = diagnose_records(_recs(compiles=lambda s, v: [3, 3] if s <= 2 else [1, 0] if s >= 4 else [0, 0]), SUMMARY)
    f = d.findings[0]
    assert (f.kind, f.severity, f.rank, f.step, f.confidence) == ("recompile_storm", "warning", 0, 4, round(5 / 6, 3))
    assert f.evidence["compiles_per_rank"] == [5, 0] and f.evidence["storm_steps"] == [4, 5, 6, 7, 8]
    assert not diagnose_records(_recs(compiles=lambda s, v: [3, 3] if s <= 2 else [0, 0]), SUMMARY).findings
    assert not diagnose_records(_recs(compiles=lambda s, v: [1, 1] if s in (1, 4, 6) else [0, 0]), SUMMARY).findings
