"""Losing a node for good: two nodes of one job, each a torchrun agent in its own network namespace.

The nodes reach each other only over a veth pair (A 10.213.7.2, B 10.213.7.1), rendezvous
over c10d at node A's address, and run with ``--nnodes 1:2`` -- the path users take across
real machines. torch numbers the nodes of a round by address, so B holds global rank 0
(it writes the metrics and hosts the ranks' store). B dies for good when it starts step 7
(``kill_node``: its agent and its rank, SIGKILL). Node A's rank fails its collective, its agent re-rendezvouses alone,
and the job continues on one node: dp 2 -> 1 with micro_batches 1 -> 2, resumed from the
step-4 checkpoint. Its per-step losses equal one uninterrupted process running the same
global batch as dp 1 x 2 micro-batches (rtol 1e-5).

Needs root and iproute2 (``ip netns``); skipped with the reason otherwise. The
namespaces and every process left in them are removed on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked_cli
import testenv

STEPS = 12
MODEL = ["--set", "train.global_batch=8", "--set", "train.seed=3", "--set", f"train.steps={STEPS}"]
ADDR = {"a": "10.213.7.2", "b": "10.213.7.1"}  # A hosts the rendezvous and survives; B is rank 0
PORT = 29400
# Short rendezvous timings keep the test brief: a dead node's heartbeat expires after 1 s x 3,
# and a rendezvous with fewer than 2 nodes completes 5 s after the first one joined.
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
TIMEOUT_S = 300


def _ip(*args: str) -> subprocess.CompletedProcess:
    return forked_cli.run(["ip", *args], capture_output=True, text=True)


def _namespace_blocker() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    return None


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair; yields {"a": name, "b": name}."""
    why = _namespace_blocker()
    if why:
        pytest.skip(f"two-node test needs network namespaces: {why}")
    tag = f"{os.getpid() % 100000}"
    ns = {n: f"chipset-el{tag}{n}" for n in "ab"}
    veth = {n: f"csel{tag}{n}" for n in "ab"}  # interface names: at most 15 characters
    made = []
    try:
        for n in "ab":
            r = _ip("netns", "add", ns[n])
            if r.returncode != 0:
                pytest.skip(f"two-node test needs network namespaces: `ip netns add` failed: {r.stderr.strip()}")
            made.append(ns[n])
        steps = [("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])]
        for n in "ab":
            steps += [("link", "set", veth[n], "netns", ns[n]),
                      ("-n", ns[n], "addr", "add", f"{ADDR[n]}/24", "dev", veth[n]),
                      ("-n", ns[n], "link", "set", veth[n], "up"),
                      ("-n", ns[n], "link", "set", "lo", "up")]
        for args in steps:
            r = _ip(*args)
            if r.returncode != 0:
                pytest.skip(f"two-node test: `ip {' '.join(args)}` failed: {r.stderr.strip()}")
        yield {**ns, "veth_a": veth["a"], "veth_b": veth["b"]}
    finally:
        for name in made:
            for pid in _ip("netns", "pids", name).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", name)  # takes its end of the veth pair (and so the pair) with it


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "TORCHELASTIC_"))}
    env.update(CHIPSET_BACKEND="cpu_sim", OMP_NUM_THREADS="1", CHIPSET_COLLECTIVE_TIMEOUT="60")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _node(ns: dict, n: str, run_dir: Path, log: Path, **env) -> subprocess.Popen:
    # gloo binds the address of the named interface: the hostname resolves to loopback here.
    cmd = ["ip", "netns", "exec", ns[n], sys.executable, "-m", "chipset.cli.main", "train", *MODEL,
           "--set", "train.checkpoint_every=4", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-endpoint", f"{ADDR['a']}:{PORT}", "--rdzv-id", f"elastic-test-{os.getpid()}",
           "--rdzv-conf", RDZV_CONF, "--local-addr", ADDR[n], "--max-restarts", "1", "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            env=_env(GLOO_SOCKET_IFNAME=ns[f"veth_{n}"], **env), start_new_session=True)


def _wait_for_agent(ns: str, launcher: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until a torchrun agent runs in namespace ``ns`` (or its launcher has exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        for pid in _ip("netns", "pids", ns).stdout.split():
            if testenv.is_agent(int(pid)):
                return
        time.sleep(0.2)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl lists a step twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def test_losing_a_node_for_good_continues_on_the_survivor_with_the_same_losses(namespaces, tmp_path):
    run = tmp_path / "elastic"
    logs = {n: tmp_path / f"node-{n}.log" for n in "ab"}
    # B's agent first: it waits for A's rendezvous store, so both join the same first round
    # (a node arriving after the first round completed would make torch re-form the job).
    nodes = {"b": _node(namespaces, "b", run, logs["b"], CHIPSET_SIM_FAULTS="kill_node:step=7",
                        CHIPSET_SIM_FAULT_DIR=tmp_path / "faults")}
    _wait_for_agent(namespaces["b"], nodes["b"])
    nodes["a"] = _node(namespaces, "a", run, logs["a"])
    # The reference: one process, the same global batch as dp 1 x 2 micro-batches, never interrupted.
    ref = tmp_path / "reference"
    reference = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *MODEL,
                                "--set", "parallel.micro_batches=2", "--run-dir", str(ref)],
                               capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    try:
        rc = {n: p.wait(timeout=TIMEOUT_S) for n, p in nodes.items()}
    finally:
        for p in nodes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = {n: logs[n].read_text() for n in "ab"}
    assert rc["a"] == 0, f"node A exited {rc['a']}:\n{out['a'][-4000:]}\n--- node B:\n{out['b'][-3000:]}"
    assert rc["b"] != 0 and "fault injected (kill_node:step=7): this node dies now" in out["b"], out["b"][-3000:]
    assert "step    7/12" in out["b"], "node B was meant to hold rank 0 (it prints the progress) until it died"

    assert ("chipset elastic: running on 1 of 2 planned node(s): world 2 -> 1, dp 2 -> 1, "
            "micro_batches 1 -> 2 (train.global_batch 8 kept, 4 sequences per micro-batch)") in out["a"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"] == {
        "planned_world_size": 2, "world_size": 1, "planned_nodes": 2, "nodes": 1, "planned_dp": 2, "dp": 1,
        "planned_micro_batches": 1, "micro_batches": 2, "global_batch": 8, "micro_batch_size": 4}
    assert summary["restarts"] == 1 and summary["resumed_step"] == 4
    assert summary["resharded"]["from"]["world_size"] == 2 and summary["resharded"]["to"]["world_size"] == 1
    assert summary["world_size"] == 1

    got, want = _losses(run), _losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), (step, got, want)
