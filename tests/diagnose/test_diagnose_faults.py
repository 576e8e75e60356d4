"""chipset diagnose on real 2-rank cpu_sim runs with each injected fault (CHIPSET_SIM_FAULTS).

One clean job and one job per fault, 6 steps of the tiny default model, side by side; each test
reads its job's run directory through ``chipset diagnose --json`` and checks the first finding
names the injected fault's kind, rank and step."""

from __future__ import annotations

import json

import pytest
import torch

import testenv
from chipset.cli.main import main
from testenv import SideBySide

pytestmark = pytest.mark.multirank

FAULTS = {
    "clean": "",
    "slow": "slow:rank=1,ms=300",
    # 300 ms against steps of 15-30 ms of compute: exposed communication stays over the rule's 75% for
    # an error even when this file's own jobs slow each rank's compute sevenfold on a 2-core machine.
    "slow_link": "slow_link:rank=1,ms=300",
    "leak": "leak:rank=0,mib=4,step=2",
    # With parallel.tp=2 every tp collective crosses the slow link: about 15 a step of the tiny model, so
    # 60 ms each is 0.9 s of communication against 0.1-0.2 s of compute on a slow or busy 2-core machine
    # (CI measured 85 ms): over the rule's 75% for an error (20 ms gave 74% there).
    "tp_slow_link": "slow_link:rank=1,ms=60",
    "slow_loader": "slow_loader:rank=1,ms=200",
    "loss_spike": "loss_spike:step=3",  # the loss of 0-based step 3 (record step 4) times 10
    "corrupt": "corrupt:rank=1,step=2",  # rank 1's all-reduce results of 0-based step 2 (record step 3) off
    # Every rank 600 ms on the host per step, outside operators and collectives. Against steps of
    # 15-30 ms of compute, slowed sevenfold (about 200 ms, profiler included) on a loaded 2-core
    # machine, the gap stays over HOST_SHARE (0.6) of the profiled step: 600 / 800 = 0.75. With
    # 150 ms it fell under it once (CI-like run with three pytest workers, 2026-12-06).
    "host": "host_delay:ms=600",
}
# The clean and host jobs profile their last steps (traces/rank<r>.json): host_overhead and top_operators.
# The clean job profiles three: with one, a single rank descheduled for most of its step on the loaded
# 2-core machine made half the spans "host overhead" (CI, 2026-12-07: one of 2 spans over 60%, 30% of
# the profiled time in all); the rule needs half the (rank, step) spans, here 3 of 6.
SETS = {"tp_slow_link": ["parallel.tp=2"], "clean": ["train.profile_steps=4:6"], "host": ["train.profile_steps=6:6"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("diagnose")

    def job(name):
        def start():
            env = testenv.clean_env()
            env["OMP_NUM_THREADS"] = "1"
            if FAULTS[name]:
                env["CHIPSET_SIM_FAULTS"] = FAULTS[name]
            sets = ["train.steps=6", "train.global_batch=2", *SETS.get(name, [])]
            r = testenv.chipset_train(base / name, 2, sets, env=env, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            (base / f"{name}.out").write_text(r.stdout + r.stderr)
            return base / name
        return start

    started = SideBySide({name: job(name) for name in FAULTS})
    yield started
    started.close()


def _diagnose(run_dir, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diagnose", str(run_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_clean_run_has_no_error_finding(runs, capsys):
    code, out = _diagnose(runs["clean"], capsys)
    assert code == 0 and not out["has_error"], out["findings"]


@pytest.mark.parametrize(("fault", "kind", "rank", "step"), [
    ("slow", "straggler", 1, 2),                 # the first steady step (step 1 is warm-up)
    ("slow_link", "communication_bound", None, 2),
    ("leak", "memory_leak", 0, 3),               # leaking from 0-based step 2 = record step 3
    ("slow_loader", "data_loader_stall", 1, 2),
    ("loss_spike", "loss_spike", None, 4),       # 0-based step 3 = record step 4
    ("corrupt", "replica_divergence", None, 3),  # two replicas: which one is off is not known
])
def test_the_injected_fault_is_ranked_first(runs, capsys, fault, kind, rank, step):
    code, out = _diagnose(runs[fault], capsys)
    first = out["findings"][0]
    assert (first["kind"], first["step"]) == (kind, step), out["findings"]
    if rank is not None:
        assert first["rank"] == rank
    assert code == 1 and first["severity"] == "error"


def test_a_slow_loader_is_a_stall_and_its_rank_an_input_pipeline_straggler(runs, capsys):
    """The loader's sleep lands in rank 1's data wait, which is part of its compute time: a straggler
    too, blamed on its input and kept a warning so the stall ranks first; the console said so live."""
    out = _diagnose(runs["slow_loader"], capsys)[1]
    strag = [f for f in out["findings"] if f["kind"] == "straggler"]
    assert [(f["rank"], f["evidence"]["cause"], f["severity"]) for f in strag] == [(1, "input pipeline", "warning")]
    console = (runs["slow_loader"].parent / "slow_loader.out").read_text()
    assert "chipset: warning: rank 1 is a straggler" in console and "waiting for its batches" in console


def _column(run_dir, key) -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_loss_spike_multiplies_that_steps_loss_and_no_other(runs, capsys):
    """The spiked job and the clean one train the same model on the same data: the same losses up
    to record step 3, then 10x the clean loss at step 4. Three float32 roundings separate the two
    (the product, and the dp all-reduce's sum in each job): within 2 eps = 4 units of roundoff."""
    clean, spiked = _column(runs["clean"], "loss"), _column(runs["loss_spike"], "loss")
    assert spiked[:3] == clean[:3]
    assert spiked[3] == pytest.approx(10 * clean[3], rel=2 * torch.finfo(torch.float32).eps, abs=0)
    # Scaled before backward, so the gradients carry it too (10x up to the roundings of every backward
    # op), not only the number written down.
    clean, spiked = _column(runs["clean"], "grad_norm"), _column(runs["loss_spike"], "grad_norm")
    assert spiked[:3] == clean[:3] and spiked[3] > 5 * clean[3]
    first = _diagnose(runs["loss_spike"], capsys)[1]["findings"][0]
    assert first["evidence"]["spike_steps"] == [4] and first["evidence"]["ratio"] > 3


@pytest.mark.parametrize(("fault", "line"), [("slow", "rank 1 is a straggler"), ("leak", "rank 0's memory grew")])
def test_the_console_warns_while_the_run_goes(runs, fault, line):
    out = (runs[fault].parent / f"{fault}.out").read_text()
    assert line in out and "chipset: warning" in out
    # The clean job shares the machine with this file's other jobs: a rank whose thread waited for a
    # CPU may be named, with that cause; no other rank warning is right for it.
    clean = (runs["clean"].parent / "clean.out").read_text().splitlines()
    warned = [x for x in clean if x.startswith("chipset: warning: rank")]
    assert all("is a straggler" in x and "waiting for a host CPU" in x for x in warned), warned


def test_a_mislaid_run_names_its_layout_and_the_planners(runs, capsys):
    """tp=2 across a slow link: communication-bound, and 'chipset plan' ranks dp=2 first for the same
    model on 1x2:sim-generic (dp moves one gradient all-reduce per step, tp two all-reduces per block)."""
    code, out = _diagnose(runs["tp_slow_link"], capsys)
    kinds = [f["kind"] for f in out["findings"]]
    assert "communication_bound" in kinds and "layout" in kinds, out["findings"]
    comm, lay = out["findings"][kinds.index("communication_bound")], out["findings"][kinds.index("layout")]
    assert comm["severity"] == "error" and code == 1
    assert lay["evidence"]["layout"] == "dp=1 tp=2 pp=1 ep=1 cp=1 zero=0"
    assert lay["evidence"]["recommended"].startswith("dp=2 tp=1 "), lay
    assert lay["severity"] == "warning" and lay["evidence"]["recommended_comm_s"] < lay["evidence"]["predicted_comm_s"]
    assert comm["evidence"]["planner_recommends"] == lay["evidence"]["recommended"]
    assert "layout" not in [f["kind"] for f in _diagnose(runs["clean"], capsys)[1]["findings"]]
    from chipset.report import load_run, render_html

    assert "recommends dp=2 tp=1" in render_html(load_run(runs["tp_slow_link"]))  # the report's Findings too


def test_corrupted_all_reduce_results_on_one_rank_split_the_replicas(runs, capsys):
    """The clean job's two dp replicas record the same checksum at every step, bit for bit; with rank
    1's all-reduce results of 0-based step 2 corrupted, they agree up to record step 2 and differ from
    step 3 on (an update is never undone); the clean job has no such finding."""
    clean = _column(runs["clean"], "param_sum")
    assert len(clean) == 6 and all(a == b for a, b in clean)
    sums = _column(runs["corrupt"], "param_sum")
    assert [a == b for a, b in sums] == [True, True, False, False, False, False]
    first = _diagnose(runs["corrupt"], capsys)[1]["findings"][0]
    assert first["evidence"]["replica_group"] == [0, 1] and first["evidence"]["last_equal_step"] == 2
    assert "replica_divergence" not in [f["kind"] for f in _diagnose(runs["clean"], capsys)[1]["findings"]]


def test_a_step_far_slower_than_planned_names_the_term(runs, capsys):
    """tp=2 across a link that adds 60 ms to each of its collectives: the tensor-parallel all-reduces
    (tp's term: dp is 1) take 10x and more of what the compute-scaled plan gives the whole step; the
    clean run is within SLOWER of its plan. Ratio mode: cpu_sim's device rates are estimates."""
    from chipset.diagnose.planned import SLOWER

    out = _diagnose(runs["tp_slow_link"], capsys)[1]
    found = [f for f in out["findings"] if f["kind"] == "slower_than_plan"]
    assert len(found) == 1, out["findings"]
    ev = found[0]["evidence"]
    assert ev["term"] == "tp" and ev["ratio"] >= SLOWER and ev["mode"].startswith("ratio")
    assert ev["gap_s"]["tp"] == max(ev["gap_s"].values()) and ev["measured_s"]["tp"] > ev["planned_s"]["tp"]
    assert ev["planned_s"]["compute"] == pytest.approx(ev["measured_s"]["compute"])  # the calibration
    assert "slower_than_plan" not in [f["kind"] for f in _diagnose(runs["clean"], capsys)[1]["findings"]]


def test_host_delay_is_host_overhead_first_and_the_clean_trace_is_not(runs, capsys):
    """600 ms per step on every rank before its forward, outside operators and collectives: the
    profiled step is mostly gap; no rank is slower than the other, so nothing else outranks it."""
    from chipset.diagnose.trace import HOST_SHARE

    code, out = _diagnose(runs["host"], capsys)
    first = out["findings"][0]
    assert first["kind"] == "host_overhead", out["findings"]
    assert first["evidence"]["over_spans"] >= 1 and first["evidence"]["gap_s"] >= 0.600  # a rank's sleep at least
    assert max(first["evidence"]["ranks_over"]) <= 1 and HOST_SHARE == 0.6
    clean = _diagnose(runs["clean"], capsys)[1]["findings"]
    assert "host_overhead" not in [f["kind"] for f in clean], clean


def test_the_profiled_operators_say_which_have_a_faster_kernel(runs, capsys):
    """cpu_sim registers no kernel: an operator a chipset kernel covers is named with the installed
    backends that register a faster one (the cpu plugin's fused_adamw, cross_entropy, ...)."""
    out = _diagnose(runs["clean"], capsys)[1]
    top = [f for f in out["findings"] if f["kind"] == "top_operators"]
    assert len(top) == 1 and top[0]["severity"] == "info"
    rows = top[0]["evidence"]["operators"]
    assert len(rows) == 5 and rows == sorted(rows, key=lambda r: -r["self_s"])
    assert top[0]["evidence"]["backend"] == "cpu_sim" and top[0]["evidence"]["backend_kernels"] == []
    assert all(r["faster_kernel"] is None or r["faster_kernel"].startswith("no faster") for r in rows)
