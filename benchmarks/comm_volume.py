"""Communication volume per step of each parallel layout: the simulator's counts beside the planner's.

    python benchmarks/comm_volume.py [--layouts dp2-z0,tp2,...] [--steps 2] [--cli] [--json out.json]

Trains a tiny model (vocabulary 127, hidden 32, 2 blocks, 4 heads, 2 KV heads, MLP 64;
4 experts top-2 for the MoE layout, 4 blocks for interleaved 1F1B; 8 sequences of 16
tokens in 2 micro-batches per dp rank, fp32) for ``--steps`` steps under each layout on cpu_sim, reads every rank's
per-step ``comm`` record from the run's metrics.jsonl (bytes handed to each collective,
``Collective.comm_stats``) and prints, per layout and op, the mean bytes per rank and
step measured, the planner's formula in the same units, the engine's documented
departures from it (``chipset.planner.engine_comm``), planner + departures, and
measured / predicted.

By default the layouts of one world size run one after another in one torchrun job (the
trainer's ``train()`` per layout, each with its own run directory), which saves a
launch per layout; ``--cli`` runs each as its own ``chipset train`` instead. The counts
are the same either way. tests/planner/test_planner_validation_comm.py imports :func:`measure`
and :func:`check` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = ["model.vocab_size=127", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=64", "train.global_batch=8", "train.seq_len=16",
         "parallel.micro_batches=2", "train.dtype=\"float32\""]
MOE = ["model.num_experts=4", "model.num_experts_per_tok=2"]

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dp2-z0": (2, ["parallel.zero=0"]),
    "dp2-z1": (2, ["parallel.zero=1"]),
    "dp2-z2": (2, ["parallel.zero=2"]),
    "dp2-z3": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.schedule=\"1f1b\"", "parallel.pipeline_split=\"1,1\""]),
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.schedule=\"interleaved_1f1b\"", "parallel.virtual_stages=2",
                            "model.num_hidden_layers=4", "parallel.pipeline_split=\"1,1,1,1\""]),
    "pp2-zbv": (2, ["parallel.pp=2", "parallel.schedule=\"zbv\"", "parallel.virtual_stages=2",
                    "model.num_hidden_layers=4", "parallel.pipeline_split=\"1,1,1,1\""]),
    "ep2": (2, ["parallel.ep=2", *MOE]),
    "cp2-allgather": (2, ["parallel.cp=2", "parallel.cp_attention=\"allgather\""]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_attention=\"ring\""]),
    "dp2-tp2-z1": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_split=\"1,1\""]),
    "tp2-pp2-sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                       "parallel.pipeline_split=\"1,1\""]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.pipeline_split=\"1,1\""]),
    "dp2-pp2-z3": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.pipeline_split=\"1,1\""]),
    "dp2-pp2-zbv-z3": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=\"zbv\"",
                           "parallel.virtual_stages=2", "model.num_hidden_layers=4",
                           "parallel.pipeline_split=\"1,1,1,1\""]),
    "dp2-tp2-pp2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.pipeline_split=\"1,1\""]),
}
DEFAULT = [n for n, (w, _) in LAYOUTS.items() if w <= 4]


def overrides(name: str, steps: int) -> list[str]:
    return [*MODEL, *LAYOUTS[name][1], f"train.steps={steps}"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env["CHIPSET_BACKEND"] = "cpu_sim"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _worker(job: Path) -> int:
    """One rank: train every layout of ``job`` in turn (all of them span the whole world)."""
    from chipset.loader import backend
    from chipset.train.config import load_config
    from chipset.train.loop import train

    spec = json.loads(job.read_text())
    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    world = b.collective.world_size()
    with open(os.devnull, "w") as quiet:
        for name, sets in spec["layouts"].items():
            cfg = load_config(None, sets).validate(world_size=world, dtypes=b.capabilities.dtypes)
            train(cfg, b, Path(spec["out"]) / name, out=quiet)
    b.collective.destroy()
    return 0


def measure(names: list[str], workdir: Path, steps: int = 2, cli: bool = False, timeout: float = 600) -> dict[str, list[dict]]:
    """``{layout: metrics.jsonl records}`` of real training runs on cpu_sim."""
    workdir.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[str]] = {}
    for n in names:
        by_world.setdefault(LAYOUTS[n][0], []).append(n)
    for world, group in by_world.items():
        if cli:
            for n in group:
                sets = [a for s in overrides(n, steps) for a in ("--set", s)]
                _run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", str(world), "--resume", "none",
                      "--run-dir", str(workdir / n), *sets], timeout)
            continue
        job = workdir / f"world{world}.json"
        job.write_text(json.dumps({"out": str(workdir), "layouts": {n: overrides(n, steps) for n in group}}))
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
              __file__, "--worker", str(job)], timeout)
    return {n: [json.loads(line) for line in (workdir / n / "metrics.jsonl").read_text().splitlines()] for n in names}


def _run(cmd: list[str], timeout: float) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")


def check(name: str, records: list[dict]) -> list[dict]:
    """Per op: measured bytes per rank and step beside planner, departures and their sum.

    Rows carry ``measured`` (mean over ranks and steps), ``predicted`` (planner +
    departures, mean over ranks), ``planner``, ``departures`` and ``exact``: every step and
    rank equals its prediction (all_to_all: the ep group's sum, which routing does not change).
    """
    from chipset.planner.engine_comm import ENGINE_OPS, departures, planned_bytes, predict, stage_of
    from chipset.train.config import load_config

    world = LAYOUTS[name][0]
    cfg = load_config(None, overrides(name, len(records))).validate(world_size=world)
    pred = [predict(cfg, r) for r in range(world)]
    stages = [stage_of(cfg, r) for r in range(world)]
    plan = [planned_bytes(cfg, s) for s in stages]
    rows = []
    seen = set(ENGINE_OPS) | {op for rec in records for op in rec["comm"]}
    for op in [*ENGINE_OPS, *sorted(seen - set(ENGINE_OPS))]:
        per_step = [rec["comm"].get(op, {}).get("bytes", [0] * world) for rec in records]
        want = [p.get(op, 0.0) for p in pred]
        if op == "all_to_all":
            exact = all(sum(got) == sum(want) for got in per_step)
        else:
            exact = all(list(map(float, got)) == want for got in per_step)
        measured = sum(map(sum, per_step)) / (world * len(per_step))
        planner = sum(p.get(op, 0.0) for p in plan) / world
        departure = sum(d.bytes for s in stages for d in departures(cfg, s) if d.op == op) / world
        if measured or any(want) or planner:
            rows.append({"layout": name, "op": op, "measured": measured, "planner": planner, "departures": departure,
                         "predicted": sum(want) / world, "exact": exact, "per_rank": per_step[-1], "want": want})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(DEFAULT), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cli", action="store_true", help="one `chipset train` per layout instead of one job per world size")
    p.add_argument("--workdir", default="runs/comm_volume")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from chipset._process import exit_rank

        exit_rank(_worker(Path(args.worker)))
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout(s) {', '.join(unknown)}; expected some of {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    runs = measure(names, Path(args.workdir), args.steps, args.cli)
    rows = [row for n in names for row in check(n, runs[n])]
    print("| layout | op | measured B/step/rank | planner | engine departures | planner + departures | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['measured'] / r['predicted']:.4f}" if r["predicted"] else "-"
        mark = "" if r["exact"] else " (not exact)"
        print(f"| {r['layout']} | {r['op']} | {r['measured']:,.0f} | {r['planner']:,.0f} | {r['departures']:+,.0f} | "
              f"{r['predicted']:,.0f} | {ratio}{mark} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
