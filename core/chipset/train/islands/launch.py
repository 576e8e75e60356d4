"""Starting the islands of a job: one world per island, each with its own backend.

``chipset train`` with ``islands.count > 1`` comes here. On one node it starts every island
(``--nproc`` split evenly); with ``--island I`` (one command per island, e.g. per node, each
with its own ``CHIPSET_BACKEND``) only island ``I``. Each island is a ``chipset.train.worker``
process (one rank) or a torchrun job (several), in ``RUN_DIR/island-<i>``, with
``CHIPSET_ISLAND`` and the islands' store (``CHIPSET_ISLANDS_STORE``) in its environment.
The store is hosted here when this command runs island 0 (at ``islands.endpoint``, or on a
free loopback port when every island runs here).

An island that exits with an error is restarted (``--max-restarts`` per island) as a joiner:
it fetches the global state at the live islands' next outer step; the others keep training
meanwhile. When every island has ended, ``RUN_DIR/summary.json`` sums them up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chipset.errors import ConfigError
from chipset.train.islands.link import (
    ISLAND_ENV,
    REJOIN_ENV,
    STORE_ENV,
    connect_store,
    mark_restarting,
)

__all__ = ["island_dir", "launch_islands", "merge_summaries", "store_endpoint"]

CONNECT_TIMEOUT_S = 15.0
"""How long a command that does not host the store tries to reach it before it refuses to start."""


def island_dir(run_dir: Path, island: int) -> Path:
    return Path(run_dir) / f"island-{island}"


def store_endpoint(cfg, islands_here: list[int]) -> tuple[str, bool]:
    """(HOST:PORT of the islands' store, whether this command hosts it). ConfigError when the
    islands cannot meet: no endpoint for a command that runs only some islands."""
    if cfg.islands.endpoint:
        return cfg.islands.endpoint, 0 in islands_here
    if len(islands_here) < cfg.islands.count:
        raise ConfigError(f"--island {islands_here[0]}: the islands of this job run from several commands, so they "
                          "need a store to meet at: set islands.endpoint = \"HOST:PORT\" (an address of the node "
                          "running island 0, the same in every command)")
    return "127.0.0.1:0", True  # the store picks a free port as it starts listening


def launch_islands(cfg, *, islands_here: list[int], backends: list[str], nproc: int, run_dir: Path,
                   config_path: Path, resume: str, max_restarts: int, out=None) -> int:
    """Run the islands ``islands_here`` (``backends[i]`` for island ``i``, ``nproc`` ranks each) to the end."""
    out = out or sys.stdout
    endpoint, host = store_endpoint(cfg, islands_here)
    store = connect_store(endpoint, timeout_s=CONNECT_TIMEOUT_S, host=host)  # unreachable: exit 2 here
    if endpoint.endswith(":0"):
        endpoint = f"{endpoint.rsplit(':', 1)[0]}:{store.port}"
    scratch = tempfile.mkdtemp(prefix="chipset-job-")
    from chipset.train.launch import JOB_TMPDIR_ENV, launch_env, torchrun_command

    def start(i: int, rejoin: bool) -> subprocess.Popen:
        d = island_dir(run_dir, i)
        d.mkdir(parents=True, exist_ok=True)
        mode = "none" if rejoin else resume
        if nproc == 1:
            cmd = [sys.executable, "-m", "chipset.train.worker", "--config", str(config_path), "--run-dir", str(d),
                   "--resume", mode]
        else:
            cmd = torchrun_command(config_path, d, nproc=nproc, resume=mode)
        env = launch_env(cmd, backends[i])
        env.update({ISLAND_ENV: str(i), STORE_ENV: endpoint, JOB_TMPDIR_ENV: scratch})
        env.pop(REJOIN_ENV, None)
        if rejoin:
            env[REJOIN_ENV] = "1"
        print(f"chipset train: island {i} ({backends[i]}, {nproc} rank(s)) in {d}"
              + (" restarted: it rejoins at the next outer step" if rejoin else ""), file=out, flush=True)
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    procs = {i: start(i, False) for i in islands_here}
    restarts = dict.fromkeys(islands_here, 0)
    codes: dict[int, int] = {}
    got: list[int] = []

    def forward(signum, frame) -> None:
        got.append(signum)
        for p in procs.values():
            if p.poll() is None:
                _signal_tree(p.pid, signum if len(got) == 1 else signal.SIGKILL)

    from chipset.train.signals import _SIGNALS

    old = {s: signal.signal(s, forward) for s in _SIGNALS}
    try:
        while len(codes) < len(procs):
            for i, p in procs.items():
                if i in codes or p.poll() is None:
                    continue
                rc = p.returncode
                if rc != 0 and not got and restarts[i] < max_restarts:
                    restarts[i] += 1
                    mark_restarting(store, i, True)  # the live islands wait for it at their next outer step
                    print(f"chipset train: island {i} exited with status {rc}; restarting it "
                          f"({restarts[i]}/{max_restarts})", file=out, flush=True)
                    procs[i] = start(i, True)
                    continue
                codes[i] = rc
                if restarts[i]:
                    mark_restarting(store, i, False)  # gone for good: outer steps stop waiting for it
                if rc != 0:
                    print(f"chipset train: island {i} exited with status {rc}; the other islands go on without it",
                          file=out, flush=True)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(scratch, ignore_errors=True)
    if got:
        return 128 + got[0]
    merge_summaries(cfg, run_dir, backends, restarts)
    return next((c for c in codes.values() if c != 0), 0)  # an island lost for good fails the job


def _island_summaries(cfg, run_dir: Path) -> list[dict | None]:
    """Each island's ``summary.json`` (None where it has none on this node)."""
    out = []
    for i in range(cfg.islands.count):
        try:
            out.append(json.loads((island_dir(run_dir, i) / "summary.json").read_text()))
        except (OSError, ValueError):
            out.append(None)
    return out


def _signal_tree(pid: int, signum: int) -> None:
    from chipset.train.signals import agent_ranks

    ranks = agent_ranks(pid)
    for target in (ranks or [pid]) if signum != signal.SIGKILL else [*ranks, pid]:
        try:
            os.kill(target, signum)
        except OSError:
            pass


def _crossed(island: dict) -> int:
    """Bytes an island's ranks handed to the link. One rank: its link's count (``cross_island``, a
    rejoin's state transfer before the first step included). Several: the steps' counts of every rank
    (``cross_island_totals``), since ``cross_island`` is the link of rank 0 alone."""
    several = (island.get("world_size") or 1) > 1 and island["cross_island_totals"]
    return int((island["cross_island_totals"] if several else island["cross_island"] or {}).get("bytes", 0))


def merge_summaries(cfg, run_dir: Path, backends: list[str], restarts: dict[int, int]) -> dict | None:
    """``RUN_DIR/summary.json`` from the islands' own (those on this node): losses, the bytes that
    crossed between islands, and whether every island ended on the same parameters."""
    per = []
    for i, s in enumerate(_island_summaries(cfg, run_dir)):
        if s is None:
            continue
        isl = s.get("islands", {})
        per.append({"island": i, "backend": s.get("backend", backends[i] if i < len(backends) else None),
                    "final_loss": s.get("final_loss"), "world_size": s.get("world_size"),
                    "layout": s.get("layout"), "params_digest": s.get("params_digest"),
                    "restarts": restarts.get(i, 0), "outer_steps": isl.get("outer_steps"),
                    "cross_island": isl.get("cross_island"), "cross_island_totals": s.get("cross_island_totals"),
                    "inner_comm_totals": s.get("comm_totals", {}),
                    "tokens_per_s": s.get("tokens_per_s"), **{k: s[k] for k in ("eval_loss", "eval_ppl") if k in s}})
    if not per:
        return None
    losses = [p["final_loss"] for p in per if isinstance(p["final_loss"], (int, float))]
    digests = {p["params_digest"] for p in per if p["params_digest"]}
    summary = {"islands": cfg.islands.count, "sync_every": cfg.islands.sync_every,
               "steps": cfg.train.steps, "final_loss": sum(losses) / len(losses) if losses else None,
               "cross_island_bytes": sum(_crossed(p) for p in per),
               "same_parameters": len(digests) == 1, "per_island": per}
    privacy = next((s["islands"]["privacy"] for s in _island_summaries(cfg, run_dir)
                    if s and "privacy" in s.get("islands", {})), None)
    if privacy is not None:
        summary["privacy"] = privacy  # the same on every client: rounds and noise are the job's
    if "eval_loss" in per[0]:
        summary["eval_loss"] = per[0]["eval_loss"]
    from chipset.train.rundir import atomic_write_text, strict_dumps

    atomic_write_text(Path(run_dir) / "summary.json", strict_dumps(summary, indent=2) + "\n")
    return summary
