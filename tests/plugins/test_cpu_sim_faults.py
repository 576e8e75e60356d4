"""cpu_sim fault injection (CHIPSET_SIM_FAULTS): parsing, kill once per job, delay, and hang -> timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import forked_cli
import testenv
from chipset.conformance._world import rank_env, session_store
from chipset.errors import ConfigError
from chipset_cpu_sim.faults import ANY_RANK, Fault, FaultPlan, fault_dir, parse_faults


# --- parsing ---------------------------------------------------------------------
def test_the_documented_example_parses():
    faults = parse_faults("kill:rank=1,step=7; delay:rank=0,ms=200 ;hang:rank=2,collective=5;kill:rank=3,collective=12")
    assert faults == [
        Fault("kill", 1, step=7, spec="kill:rank=1,step=7"),
        Fault("delay", 0, ms=200, spec="delay:rank=0,ms=200"),
        Fault("hang", 2, collective=5, spec="hang:rank=2,collective=5"),
        Fault("kill", 3, collective=12, spec="kill:rank=3,collective=12"),
    ]


def test_input_faults_parse_with_the_spike_factor_defaulting_to_10():
    faults = parse_faults("slow_loader:rank=1,ms=200;loss_spike:step=4;loss_spike:step=6,factor=3")
    assert faults == [
        Fault("slow_loader", 1, ms=200, spec="slow_loader:rank=1,ms=200"),
        Fault("loss_spike", ANY_RANK, step=4, spec="loss_spike:step=4", factor=10),
        Fault("loss_spike", ANY_RANK, step=6, spec="loss_spike:step=6,factor=3", factor=3),
    ]
    plan = FaultPlan(faults)
    assert [plan.loss_factor(s) for s in (3, 4, 5, 6)] == [1.0, 10.0, 1.0, 3.0]


def test_empty_means_no_faults():
    assert parse_faults("") == [] and parse_faults(None) == [] and parse_faults(" ; ") == []


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("explode:rank=1", "unknown kind 'explode'"),
        ("kill rank=1,step=2", "missing ':'"),
        ("kill:rank=1", "exactly one of step or collective"),
        ("kill:rank=1,step=2,collective=3", "exactly one of step or collective"),
        ("delay:rank=0", "missing ms"),
        ("delay:ms=10", "missing rank"),
        ("hang:rank=x,collective=1", "rank='x' is not an integer"),
        ("hang:rank=1,step=2", "unknown key 'step' for hang"),
        ("delay:rank=0,ms=-5", "must not be negative"),
        ("kill:rank=1,rank=2,step=1", "given twice"),
        ("kill:rank", "is not key=value"),
        ("loss_spike:step=2,factor=1", "would not raise the loss"),
        ("loss_spike:rank=0,step=2", "unknown key 'rank' for loss_spike"),
        ("slow_loader:rank=1", "missing ms"),
    ],
)
def test_malformed_entries_are_config_errors_that_quote_the_entry(text, needle):
    with pytest.raises(ConfigError) as info:
        parse_faults(f"delay:rank=0,ms=1;{text}")
    msg = str(info.value)
    assert needle in msg
    assert repr(text) in msg and "CHIPSET_SIM_FAULTS" in msg and "kill:rank=1,step=7" in msg


def test_malformed_faults_fail_backend_load_with_exit_code_2():
    env = testenv.clean_env()
    env.update(CHIPSET_BACKEND="cpu_sim", CHIPSET_SIM_FAULTS="kill:rank=1")
    proc = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "info"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "CHIPSET_SIM_FAULTS" in proc.stderr and "step or collective" in proc.stderr


def test_fault_dir_comes_from_the_env_or_the_torchelastic_run_id(monkeypatch, tmp_path):
    monkeypatch.delenv("CHIPSET_SIM_FAULT_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert fault_dir() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id names no job
    assert fault_dir() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert fault_dir().name == f"chipset-sim-faults-{os.getuid()}-job42"
    monkeypatch.setenv("CHIPSET_SIM_FAULT_DIR", str(tmp_path))
    assert fault_dir() == tmp_path


# --- single-process behaviour ------------------------------------------------------
STEPS = textwrap.dedent("""
    import chipset, torch
    c = chipset.backend("cpu_sim").collective
    if MODE == "collective":
        c.init_process_group(rank=0, world_size=1)
        for i in range(5):
            c.all_reduce(torch.ones(4))
            print(i, flush=True)
        c.destroy()  # leaving a gloo group alive at exit can abort the interpreter
    else:
        for step in range(5):
            c.notify_step(step)
            print(step, flush=True)
""")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "TORCHELASTIC_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _steps(mode: str, **env):
    proc = forked_cli.run([sys.executable, "-c", f"MODE = {mode!r}\n" + STEPS], capture_output=True, text=True,
                          env=_env(**env), timeout=120)
    return proc.returncode, [int(x) for x in proc.stdout.split()], proc.stderr


def test_kill_at_a_step_dies_abruptly_once_per_job(tmp_path):
    env = dict(RANK=1, CHIPSET_SIM_FAULTS="kill:rank=1,step=2", CHIPSET_SIM_FAULT_DIR=tmp_path)
    rc, steps, err = _steps("step", **env)
    assert rc == -9 and steps == [0, 1], (rc, steps, err)
    assert "fault injected (kill:rank=1,step=2)" in err
    assert (tmp_path / "kill-rank1-step2.done").exists()
    rc, steps, _ = _steps("step", **env)  # the elastic restart: the kill does not repeat
    assert rc == 0 and steps == [0, 1, 2, 3, 4]


def test_kill_spares_other_ranks(tmp_path):
    rc, steps, _ = _steps("step", RANK=0, CHIPSET_SIM_FAULTS="kill:rank=1,step=2", CHIPSET_SIM_FAULT_DIR=tmp_path)
    assert rc == 0 and steps == [0, 1, 2, 3, 4]


def test_kill_does_not_repeat_after_a_torchelastic_restart():
    rc, steps, _ = _steps("step", RANK=1, CHIPSET_SIM_FAULTS="kill:rank=1,step=2", TORCHELASTIC_RESTART_COUNT=1)
    assert rc == 0 and steps == [0, 1, 2, 3, 4]


def test_kill_at_a_collective_counts_collectives_from_zero(tmp_path):
    rc, done, _ = _steps("collective", CHIPSET_SIM_FAULTS="kill:rank=0,collective=3", CHIPSET_SIM_FAULT_DIR=tmp_path)
    assert rc == -9 and done == [0, 1, 2]


def test_delay_makes_every_collective_of_that_rank_late():
    code = textwrap.dedent("""
        import time, chipset, torch
        c = chipset.backend("cpu_sim").collective
        c.init_process_group(rank=0, world_size=1)
        t0 = time.perf_counter()
        for _ in range(3):
            c.all_reduce(torch.ones(4))
        print(time.perf_counter() - t0, c.stats_dict()["all_reduce@world"]["calls"], flush=True)
        c.destroy()  # leaving a gloo group alive at exit can abort the interpreter
    """)
    proc = forked_cli.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(CHIPSET_SIM_FAULTS="delay:rank=0,ms=200"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    took, calls = proc.stdout.split()
    assert float(took) >= 0.6 and int(calls) == 3


# --- four ranks, one never arrives -------------------------------------------------
HANG = textwrap.dedent("""
    import json, os, sys, time, torch, chipset
    from pathlib import Path
    # The rendezvous runs under the same 5 s limit: start it only once every rank has imported
    # torch (4 imports on a loaded 2-core machine can finish more than 5 s apart).
    out_path = Path(sys.argv[1])
    out_path.with_suffix(".ready").touch()
    while len(list(out_path.parent.glob("*.ready"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    c = chipset.backend("cpu_sim").collective
    c.init_process_group()
    out = {"done": []}
    t0 = time.monotonic()
    try:
        for i in range(3):
            t0 = time.monotonic()
            x = torch.ones(1000)
            c.all_reduce(x)
            out["done"].append(i)
    except Exception as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        out["waited"] = time.monotonic() - t0
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    os._exit(0)
""")


def test_a_dropped_connection_after_most_of_the_timeout_is_reported_as_a_timeout(monkeypatch):
    """A hung rank's neighbours may see the connection a peer dropped on its own timeout rather
    than a timeout of their own: after half the limit that is a CollectiveTimeoutError; a
    peer that died at once (a connection reset right away) stays a plain CollectiveError."""
    from chipset.errors import CollectiveError, CollectiveTimeoutError
    from chipset.interfaces.collective import _past_timeout

    monkeypatch.setenv("CHIPSET_COLLECTIVE_TIMEOUT", "10")
    dropped = CollectiveError("all_reduce on world (4 ranks) failed: Connection closed by peer")
    late = _past_timeout(dropped, 9.98)
    assert type(late) is CollectiveTimeoutError and "CHIPSET_COLLECTIVE_TIMEOUT" in str(late)
    assert "Connection closed by peer" in str(late)
    assert _past_timeout(dropped, 0.2) is dropped
    timed_out = CollectiveTimeoutError("all_reduce timed out")
    assert _past_timeout(timed_out, 12.0) is timed_out
    other = ValueError("not a collective's error")
    assert _past_timeout(other, 12.0) is other


def test_four_rank_all_reduce_with_a_hung_rank_ends_in_collective_timeout_error(tmp_path):
    timeout_s = 5
    store = session_store()  # hosted here: no free port that a rank binds later
    procs = []
    t0 = time.monotonic()
    for rank in range(4):
        env = _env(**rank_env(store), RANK=rank, WORLD_SIZE=4,
                   CHIPSET_COLLECTIVE_TIMEOUT=timeout_s, CHIPSET_SIM_FAULTS="hang:rank=2,collective=1")
        procs.append(subprocess.Popen([sys.executable, "-c", HANG, str(tmp_path / f"r{rank}.json")], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            p.wait(timeout=timeout_s + 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.monotonic() - t0
    missing = {r: p.stderr.read()[-2000:] for r, p in enumerate(procs) if not (tmp_path / f"r{r}.json").is_file()}
    assert not missing, f"ranks that wrote no result, with their stderr: {missing}"
    results = [json.loads(Path(tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    for rank in (0, 1, 3):
        r = results[rank]
        assert r["done"] == [0], r
        assert r["error"] == "CollectiveTimeoutError", r
        assert r["waited"] <= timeout_s + 30, r
        assert "CHIPSET_COLLECTIVE_TIMEOUT" in r["message"]
    hung = results[2]
    assert hung["done"] == [0] and hung["error"] == "CollectiveError"
    assert "withheld collective #1 on purpose" in hung["message"]
    assert wall < timeout_s + 60


def test_the_diagnose_faults_parse():
    faults = parse_faults("slow:rank=1,ms=300;slow_link:rank=0,ms=50;leak:rank=1,mib=4,step=3;leak:rank=0,mib=2")
    assert [(f.kind, f.rank, f.ms, f.mib, f.step) for f in faults] == [
        ("slow", 1, 300, 0, None), ("slow_link", 0, 50, 0, None), ("leak", 1, 0, 4, 3), ("leak", 0, 0, 2, None)]
    with pytest.raises(ConfigError, match="missing mib"):
        parse_faults("leak:rank=1")


def test_corrupt_concerns_one_ranks_floating_all_reduce_results_in_one_step():
    import torch

    from chipset_cpu_sim.collective import _corrupt

    plan = FaultPlan(parse_faults("corrupt:rank=1,step=2"))
    f32, i64 = [torch.ones(3)], [torch.ones(3, dtype=torch.int64)]
    plan.on_step(1, 1)
    assert not plan.corrupts(1, "all_reduce", f32)
    plan.on_step(1, 2)
    assert plan.corrupts(1, "all_reduce", f32)
    assert not any([plan.corrupts(0, "all_reduce", f32), plan.corrupts(1, "all_gather", f32),
                    plan.corrupts(1, "all_reduce", i64)])
    t = torch.tensor([2.0, 2.0])
    _corrupt(t)
    assert t.tolist() == [2.0 + 2.0 / 1024 + 2.0 ** -10, 2.0]
    with pytest.raises(ConfigError, match="missing step"):
        parse_faults("corrupt:rank=1")


def test_a_kill_with_island_concerns_only_that_island(monkeypatch):
    from chipset_cpu_sim.faults import ISLAND_ENV, parse_faults

    (f,) = parse_faults("kill:rank=0,step=9,island=1")
    assert (f.rank, f.step, f.island) == (0, 9, 1) and "island1" in f.marker_name
    monkeypatch.setenv(ISLAND_ENV, "0")
    assert not f.here()
    monkeypatch.setenv(ISLAND_ENV, "1")
    assert f.here()
    (g,) = parse_faults("kill:rank=0,step=9")
    monkeypatch.delenv(ISLAND_ENV)
    assert g.island is None and g.here()


def test_host_delay_concerns_every_rank_or_the_one_named():
    """host_delay without rank concerns every rank; with rank=R only R (the entries add up)."""
    from chipset_cpu_sim.faults import ANY_RANK, FaultPlan

    every, one = parse_faults("host_delay:ms=150;host_delay:rank=1,ms=20")
    assert (every.kind, every.rank, every.ms, one.rank, one.ms) == ("host_delay", ANY_RANK, 150, 1, 20)
    plan = FaultPlan([every, one])
    assert (plan.host_delay_s(0), plan.host_delay_s(1)) == (0.150, 0.170)
    assert FaultPlan(parse_faults("slow:rank=0,ms=300")).host_delay_s(0) == 0.0
    with pytest.raises(ConfigError, match="missing ms"):
        parse_faults("host_delay:rank=1")
