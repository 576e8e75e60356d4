"""Stopping a job: SIGINT/SIGTERM stop every rank at one step with one checkpoint and one line;
a SIGKILLed torchrun agent takes its ranks with it.

Reproduces issue 14 ("SIGINT/SIGTERM to the launcher, or SIGKILL of the torchrun agent,
leaves the ranks training and saving"): before the fix a signal to ``chipset train`` left
the ranks running and printed a traceback per rank, and a killed agent left orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked_cli
import testenv
from chipset.train.checkpoint import store
from chipset.train.signals import agent_ranks
from testenv import clean_env

LONG = ["--set", "train.steps=100000", "--set", "train.global_batch=4"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chipset.cli.main", "train", *LONG, *extra, "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _steps(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _wait_training(proc: subprocess.Popen, run: Path, steps: int = 2, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and _steps(run) < steps:
        time.sleep(0.2)
    if proc.poll() is not None or _steps(run) < steps:
        out, err = proc.communicate(timeout=60) if proc.poll() is None else proc.communicate()
        pytest.fail(f"the job did not start training (rc {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
                ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _stop(proc: subprocess.Popen, signum: int, run: Path):
    try:
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out, err


def _check_stopped(proc, out: str, err: str, signum: int, run: Path, ckpt: bool) -> None:
    assert proc.returncode == 128 + signum, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("chipset train: interrupted")]
    assert len(lines) == 1, err[-3000:]
    step = int(lines[0].split("interrupted at step ")[1].split(";")[0])
    assert step == _steps(run)  # the line names the last step the ranks completed
    if ckpt:
        path = store.checkpoint_dir(run, step)
        assert f"checkpoint saved to {path}" in lines[0] and "--resume auto" in lines[0]
        assert store.verify(path) is None  # complete and verified
        assert max(c.step for c in store.list_checkpoints(run)) == step
    else:
        assert store.list_checkpoints(run) == []
    assert not (run / "interrupted.json").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_one_process_job_stops_on_a_signal_and_saves_once(tmp_path, signum):
    run = tmp_path / "run"
    proc = _start(run, "--set", "train.checkpoint_every=1000")
    _wait_training(proc, run)
    out, err = _stop(proc, signum, run)
    _check_stopped(proc, out, err, signum, run, ckpt=True)


def test_one_process_job_without_checkpoints_stops_and_saves_nothing(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "--set", "train.checkpoint_every=0")  # checkpoints off (they are on by default)
    _wait_training(proc, run)
    out, err = _stop(proc, signal.SIGINT, run)
    _check_stopped(proc, out, err, signal.SIGINT, run, ckpt=False)
    assert "no checkpoint saved" in err


@pytest.mark.multirank
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_two_rank_job_stops_on_a_signal_to_the_launcher_and_resumes(tmp_path, signum):
    run = tmp_path / "run"
    proc = _start(run, "--nproc", "2", "--set", "train.checkpoint_every=1000")
    _wait_training(proc, run)
    ranks = _descendants(proc.pid)
    out, err = _stop(proc, signum, run)
    _check_stopped(proc, out, err, signum, run, ckpt=True)
    assert not [p for p in ranks if _alive(p)]  # agent and ranks are gone
    if signum != signal.SIGINT:
        return  # the resume below is the same after either signal: it runs once
    step = _steps(run)
    # The printed command resumes from that checkpoint.
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", f"train.steps={step + 1}",
                        "--set", "train.global_batch=4", "--set", "train.checkpoint_every=1000", "--nproc", "2",
                        "--run-dir", str(run), "--resume", "auto"], capture_output=True, text=True, env=_env(),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step {step}" in r.stdout + r.stderr and _steps(run) == step + 1


def _is_agent(pid: int) -> bool:
    """torch's elastic agent, as chipset train starts it: forked (named pt_elastic by torch), or
    python -m chipset.train.agent (train/agent.py)."""
    return testenv.is_agent(pid)


@pytest.mark.multirank
def test_a_signal_to_one_rank_stops_every_rank_together(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "--nproc", "2", "--set", "train.checkpoint_every=1000")
    _wait_training(proc, run)
    agents = [p for p in _descendants(proc.pid) if _is_agent(p)]
    assert len(agents) == 1
    workers = agent_ranks(agents[0])
    assert len(workers) == 2  # the ranks, below the torchrun agent's fork server (train/agent.py)
    servers = {_parent(p) for p in workers}
    assert len(servers) == 1 and servers != {agents[0]} and _parent(servers.pop()) == agents[0]
    server = _parent(workers[0])
    assert b"multiprocessing.forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()
    os.kill(max(workers), signal.SIGTERM)  # one rank only
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    _check_stopped(proc, out, err, signal.SIGTERM, run, ckpt=True)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


@pytest.mark.multirank
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_sigkill_of_the_torchrun_agent_kills_its_ranks(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "--nproc", "2")
    try:
        _wait_training(proc, run)
        agents = [p for p in _descendants(proc.pid) if _is_agent(p)]
        assert len(agents) == 1
        workers = _descendants(agents[0])
        assert len(workers) >= 2
        os.kill(agents[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)], "ranks outlived their killed agent"
        proc.communicate(timeout=120)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_rank_stuck_after_a_signal_exits_with_a_logged_line(tmp_path):
    """The grace thread's note is a log record with the rank prefix, flushed before the hard exit."""
    code = ("import os, signal, time\n"
            "from chipset.logs import configure\n"
            "from chipset.train import signals\n"
            "configure(3)\n"
            "signals.install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)  # a step that never ends\n")
    env = clean_env()
    env.update(CHIPSET_STOP_GRACE_S="0.5", RANK="3")
    r = forked_cli.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 128 + signal.SIGTERM
    assert ("[rank 3] ERROR chipset.train.signals: rank 3 did not reach the end of its step within 0.5 s "
            "of SIGTERM; exiting") in r.stderr, r.stderr
