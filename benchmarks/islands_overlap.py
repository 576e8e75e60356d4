"""Blocking against delayed outer steps (``islands.overlap``) over a slow link between two islands.

Two one-rank islands on cpu_sim, each in its own network namespace, joined by a veth pair whose
two ends are rate-limited with tc's token bucket filter (``--rate`` each way; netem, for a
delay, is not in this machine's kernel): the islands' store, quorum
and gloo exchange all cross that link, and nothing else does. The same job runs with
``islands.overlap = "off"`` and ``"delayed"``, alternating, ``--repeats`` times each; reported:
island 0's summed step times (the training loop, every outer step inside it), the job's wall time
(both islands' commands, start-up included) and the seconds the link's ops held island 0 up
(``cross_island`` seconds: blocking, the whole exchange; delayed, the waits at the next outer step).

Needs root and iproute2 (``ip netns``, ``tc``). Usage::

    CHIPSET_BACKEND=cpu_sim python benchmarks/islands_overlap.py --rate 4mbit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ADDR = {"a": "10.213.9.2", "b": "10.213.9.1"}
PORT = 29671
MODEL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=256"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _namespaces(tag: str, rate: str) -> dict:
    ns = {n: f"chipset-ov{tag}{n}" for n in "ab"}
    veth = {n: f"csov{tag}{n}" for n in "ab"}
    for n in "ab":
        _ip("netns", "add", ns[n])
    return {**ns, **{f"veth_{n}": v for n, v in veth.items()}}


def _link(ns: dict, rate: str) -> None:
    veth = {n: ns[f"veth_{n}"] for n in "ab"}
    _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
    for n in "ab":
        _ip("link", "set", veth[n], "netns", ns[n])
        _ip("-n", ns[n], "addr", "add", f"{ADDR[n]}/24", "dev", veth[n])
        _ip("-n", ns[n], "link", "set", veth[n], "up")
        _ip("-n", ns[n], "link", "set", "lo", "up")
        subprocess.run(["ip", "netns", "exec", ns[n], "tc", "qdisc", "add", "dev", veth[n], "root", "tbf",
                        "rate", rate, "burst", "32kbit", "latency", "2s"], check=True, capture_output=True, text=True)


def _run(ns: dict, run_dir: Path, sets: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "TORCHELASTIC_"))}
    env.update(CHIPSET_BACKEND="cpu_sim", OMP_NUM_THREADS="1")
    procs = []
    t0 = time.perf_counter()
    for i, n in enumerate("ab"):
        cmd = ["ip", "netns", "exec", ns[n], sys.executable, "-m", "chipset.cli.main", "train", "--island", str(i),
               "--nproc", "1", "--run-dir", str(run_dir), "--set", f'islands.endpoint="{ADDR["a"]}:{PORT}"',
               *[a for s in sets for a in ("--set", s)]]
        procs.append(subprocess.Popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": ns[f"veth_{n}"]},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5 if i == 0 else 0)  # island 0 hosts the store
    outs = [p.communicate(timeout=900)[0] for p in procs]
    wall = time.perf_counter() - t0
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"islands job failed ({p.returncode}):\n{out[-3000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="4mbit", help="netem rate of each end of the link (default 4mbit)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("tc") is None:
        raise SystemExit("needs root, iproute2 and tc (network namespaces and netem)")
    base = [f"train.steps={args.steps}", "train.global_batch=8", "train.seq_len=64", "train.checkpoint_every=0",
            *MODEL, "islands.count=2", f"islands.sync_every={args.sync_every}"]
    ns = _namespaces(str(os.getpid() % 100000), args.rate)
    root = Path(tempfile.mkdtemp(prefix="chipset-overlap-"))
    got: dict[str, list[tuple[float, float, float]]] = {"off": [], "delayed": []}
    try:
        _link(ns, args.rate)
        for r in range(args.repeats):
            for mode in ("off", "delayed"):
                run = root / f"{mode}-{r}"
                wall = _run(ns, run, [*base, f'islands.overlap="{mode}"'])
                rows = [json.loads(x) for x in (run / "island-0" / "metrics.jsonl").read_text().splitlines()]
                s = json.loads((run / "island-0" / "summary.json").read_text())
                got[mode].append((sum(x["step_time_s"] for x in rows), wall, s["islands"]["cross_island"]["seconds"]))
    finally:
        for n in "ab":
            subprocess.run(["ip", "netns", "del", ns[n]], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    params = 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    print(f"2 islands x 1 rank, cpu_sim, {params:,} parameters ({4 * params:,} B fp32 per exchange), "
          f"{args.steps} steps, H {args.sync_every}; link {args.rate} each way")
    for mode, rows in got.items():
        print(f"overlap {mode:8s} steps " + ", ".join(f"{x[0]:.2f}" for x in rows) + " s; wall "
              + ", ".join(f"{x[1]:.1f}" for x in rows) + " s; held up by the link "
              + ", ".join(f"{x[2]:.2f}" for x in rows) + " s")
    best = {m: min(x[0] for x in rows) for m, rows in got.items()}
    print(f"steps, best of {args.repeats}: blocking / delayed = {best['off'] / best['delayed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
