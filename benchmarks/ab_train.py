"""The same ``chipset train`` under two chipset source trees: collective bytes and step time side by side.

    git archive REV_A core plugins | tar -x -C /tmp/a     # one tree per revision to compare
    git archive REV_B core plugins | tar -x -C /tmp/b
    python benchmarks/ab_train.py /tmp/a/core /tmp/b/core --reps 5 -- --nproc 2 --set parallel.tp=2 ...

Runs ``python -m chipset.cli.main train ARGS --resume none`` with ``PYTHONPATH`` set to each
tree (its core and, when the archive holds them, its plugins/*) in turn (a, b, a, b, ... so that load on a shared host falls on both alike), on
cpu_sim. From every run's metrics.jsonl, after the first ``--skip`` steps: the bytes and
calls per collective op of rank 0 (the simulator's exact count, the same every step and
run), the median step time and the median per-rank mean of ``comm_s`` (time inside
collectives), and with ``--project PROFILE`` among the train arguments the step time the
planner projects for the run's FLOPs and counted bytes on that device (summary.json).
Prints one row per tree (median over runs, with the runs' range) and b / a.
Step times on a loaded host scatter by tens of percent between runs: read them with the
range, and the bytes as exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def run(src: Path, args: list[str], run_dir: Path) -> tuple[list[dict], dict]:
    """One training run under the chipset tree ``src``: its metrics.jsonl records and summary.json."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    plugins = sorted(str(d) for d in (src.parent / "plugins").glob("*") if d.is_dir())  # the tree's own plugins
    env.update(CHIPSET_BACKEND="cpu_sim", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(src), *plugins]))
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts clean
    cmd = [sys.executable, "-m", "chipset.cli.main", "train", *args, "--resume", "none", "--run-dir", str(run_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def summarise(records: list[dict], summary: dict, skip: int) -> dict:
    steady = records[skip:]
    if not steady:
        raise SystemExit(f"only {len(records)} steps: train.steps must exceed --skip {skip}")
    comm = steady[0]["comm"]
    return {
        "bytes": {op: c["bytes"][0] for op, c in comm.items()},
        "calls": {op: c["calls"][0] for op, c in comm.items()},
        "step_s": statistics.median(r["step_time_s"] for r in steady),
        "comm_s": statistics.median(statistics.mean(r["comm_s"]) for r in steady),
        # with --project PROFILE: the planner's step time for these FLOPs and counted bytes on PROFILE
        "projected_s": (summary.get("projection") or {}).get("step_time_s"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Everything after -- is passed to chipset train.")
    p.add_argument("a", type=Path, help="first tree's import root (the folder holding chipset/)")
    p.add_argument("b", type=Path, help="second tree's import root")
    p.add_argument("--reps", type=int, default=3, help="runs per tree, interleaved")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the timings")
    p.add_argument("--workdir", type=Path, default=Path("runs/ab"), help="run directories (replaced on a rerun)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, args = p.parse_args(argv[:cut]), argv[cut + 1:]
    for src in (ns.a, ns.b):
        if not (src / "chipset" / "__init__.py").is_file():
            print(f"{src}: no chipset/__init__.py there; expected a tree's import root (e.g. /tmp/a/core after git archive)",
                  file=sys.stderr)
            return 2
    got: dict[str, list[dict]] = {"a": [], "b": []}
    for rep in range(ns.reps):
        for name, src in (("a", ns.a), ("b", ns.b)):
            got[name].append(summarise(*run(src.resolve(), args, ns.workdir / f"{name}-{rep + 1}"), ns.skip))
    print("| tree | collective bytes / step / rank (calls) | step time (s), median [range] | in collectives (s) "
          "| projected step (s) |")
    print("|---|---|---|---|---|")
    med = {}
    for name, runs in got.items():
        ops = ", ".join(f"{op} {b:,} ({runs[0]['calls'][op]})" for op, b in runs[0]["bytes"].items())
        med[name] = {k: statistics.median(r[k] for r in runs) for k in ("step_s", "comm_s")}
        med[name]["bytes"] = sum(runs[0]["bytes"].values())
        med[name]["projected_s"] = runs[0]["projected_s"]
        proj = "-" if runs[0]["projected_s"] is None else f"{runs[0]['projected_s']:.3g}"
        lo, hi = min(r["step_s"] for r in runs), max(r["step_s"] for r in runs)
        print(f"| {name} | {ops} | {med[name]['step_s']:.3f} [{lo:.3f}-{hi:.3f}] | {med[name]['comm_s']:.3f} | {proj} |")
    a, b = med["a"], med["b"]
    proj = "-" if a["projected_s"] is None else f"{b['projected_s'] / a['projected_s']:.3f}"
    print(f"| b / a | {b['bytes'] / a['bytes']:.3f} | {b['step_s'] / a['step_s']:.3f} | {b['comm_s'] / a['comm_s']:.3f} "
          f"| {proj} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
