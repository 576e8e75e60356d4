"""Run a test file's jobs on real processes and collect what each job's rank 0 saved.

A multi-rank test file (tests/<room>/test_*.py, e.g. tests/parallel/test_engine_tp.py) is also its jobs' script: ``python FILE
MODE OUT`` is one process (the single-process reference), ``torchrun --nproc-per-node=N
FILE MODE OUT`` is N ranks over gloo on the default backend. Inside a job, ``start()``
binds the device and joins the process group; ``finish()`` saves rank 0's results to OUT
and ends the rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import testenv


def merge(base: dict, over: dict) -> dict:
    """A copy of ``base`` with each of ``over``'s sections updated into it (one level deep)."""
    out = {k: dict(v) for k, v in base.items()}
    for k, v in over.items():
        out.setdefault(k, {}).update(v)
    return out


def env() -> dict:
    """The environment for a job: the default backend (no selection variables), one thread per rank."""
    e = testenv.clean_env(keep_settings=True)
    e["OMP_NUM_THREADS"] = "1"  # 2 cores shared by every rank: more threads only contend
    return e


def require(devices: int) -> None:
    """Skip unless the default backend declares multi_process and has ``devices`` devices."""
    import chipset

    b = chipset.backend()
    if not b.capabilities.multi_process:
        pytest.skip("backend does not declare multi_process")
    if b.device.device_count() < devices:
        pytest.skip(f"needs {devices} devices, the backend has {b.device.device_count()}")


def _launch(script: Path, mode: str, ranks: int, out: Path, log: Path):
    """The job as a fork of tests/forked_cli.py's server (torch imported once): ``python FILE MODE OUT``,
    or for several ranks ``python -m torch.distributed.run --standalone --nproc-per-node=N FILE MODE OUT``."""
    import forked_cli

    argv = [str(script), mode, str(out)]
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    cmd = [sys.executable, *torchrun, *argv]
    if not forked_cli.forkable(env()):  # a start-time variable set for the run: its own interpreter
        with log.open("w") as f:
            return subprocess.Popen(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT)
    what = forked_cli.target(cmd) or ("script", str(script))
    return forked_cli.Forked(cmd, what, cmd[3:] if torchrun else argv[1:], env=env(), cwd=None, out=str(log))


def run_jobs(script: Path, waves: list[dict[str, int]], tmp: Path, *, timeout: float = 400) -> dict[str, dict]:
    """Run ``script``'s jobs and return {mode: what its rank 0 saved}.

    ``waves``: [{mode: ranks}, ...]; the jobs of a wave run side by side (one rank waiting
    on a peer leaves the core to another job), the next wave starts when they all ended.
    ``ranks`` 1 is a plain process. A job that fails fails the caller with its log's tail.
    """
    import time

    results = {}
    for wave in waves:
        logs = {mode: tmp / f"{mode}.log" for mode in wave}
        procs = {mode: _launch(script, mode, ranks, tmp / f"{mode}.pt", logs[mode]) for mode, ranks in wave.items()}
        deadline = time.monotonic() + timeout
        try:
            for p in procs.values():
                p.wait(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()  # torchrun passes SIGTERM on to its ranks; SIGKILL would orphan them
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for mode, p in procs.items():
            text = logs[mode].read_text(errors="replace") if logs[mode].exists() else ""
            assert p.returncode == 0, f"job {mode} ({wave[mode]} ranks) exited {p.returncode}:\n{text[-6000:]}"
            results[mode] = torch.load(tmp / f"{mode}.pt", weights_only=False)
    return results


def start():
    """In a job: the default backend with this rank's device bound and the process group joined."""
    from chipset.loader import backend

    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    return b


def finish(b, results: dict, out: str) -> None:
    """In a job: rank 0 saves ``results`` to ``out``; every rank leaves the group and ends.

    Ends through exit_rank (no interpreter teardown), where torch/gloo sometimes abort a
    finished rank (chipset/_process.py says when).
    """
    from chipset._process import exit_rank

    if b.collective.rank() == 0:
        torch.save(results, out)
    b.collective.destroy()
    exit_rank(0)
