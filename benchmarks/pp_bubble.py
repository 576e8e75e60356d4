"""Measured pipeline bubble of chipset's schedules vs (p-1)/m (docs/formulas.md), on any backend.

Each forward sleeps ``--forward-ms`` and each backward ``--backward-ms`` (default 250/500)
after its real compute, so a step is bound by the schedule rather than by Python and
transfer latency; the model is tiny (one 16-token sequence per micro-batch). For each
schedule and m, after a warm-up step, ``--steps`` steps are timed: bubble =
(makespan over all ranks of the step's compute instructions) / (mean per-rank busy
time) - 1. Reported: the median and the minimum over steps, theory (``bubble_fraction``) and the
schedule checker's simulated bubble (its timeline under the runtime's transfer semantics, with
F = 1, B = 2 units: equal to theory for every schedule since zero bubble runs ZB-H1's own order).

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/pp_bubble.py \
        [--schedules gpipe,1f1b,interleaved_1f1b,zero_bubble,zbv] [--micro-batches 4,8] [--steps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from chipset.loader import backend
from chipset.train import build
from chipset.train.config import RunConfig


def measure(b, schedule: str, m: int, steps: int, delay: tuple[float, float]) -> dict:
    col = b.collective
    p = col.world_size()
    cfg = RunConfig.from_dict({
        "model": {"num_hidden_layers": max(4, 2 * p)},  # ZBV: a block per chunk at least
        "train": {"global_batch": m, "seq_len": 16},
        "parallel": {"pp": p, "schedule": schedule, "micro_batches": m,
                     "virtual_stages": 2 if schedule in ("interleaved_1f1b", "zbv") else 1},
    }).validate(world_size=p)
    engine, data, _ = build(cfg, b)
    batches = [data.batch(0, 0, 1, i, m, device=engine.device) for i in range(m)]
    engine.forward_backward_step(batches)
    engine.step(1e-3)
    engine.compute_delay = delay
    bubbles = []
    for _ in range(steps):
        col.barrier()
        engine.forward_backward_step(batches)
        engine.step(1e-3)
        t = torch.tensor([[s, e] for _, s, e in engine.timings], dtype=torch.float64)
        allt = torch.zeros((p, *t.shape), dtype=torch.float64)
        allt[col.rank()] = t
        col.all_reduce(allt, "sum")
        busy = (allt[..., 1] - allt[..., 0]).sum(-1)
        bubbles.append(float((allt[..., 1].max() - allt[..., 0].min()) / busy.mean() - 1))
    theory = engine.schedule.theoretical_bubble()
    return {"schedule": schedule, "p": p, "m": m, "theory": theory, "simulated": engine.sim.bubble,
            "median": statistics.median(bubbles),
            "min": min(bubbles), "steps": bubbles,
            "median_off_by": statistics.median(bubbles) / theory - 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="gpipe,1f1b")
    # Not --m: torchrun's own parser reads it as an abbreviation of its options and stops.
    ap.add_argument("--micro-batches", default="4,8", help="comma-separated micro-batch counts")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forward-ms", type=float, default=250)
    ap.add_argument("--backward-ms", type=float, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    delay = (args.forward_ms / 1000, args.backward_ms / 1000)
    rows = [measure(b, s, int(m), args.steps, delay) for s in args.schedules.split(",") for m in args.micro_batches.split(",")]
    if b.collective.rank() == 0:
        for r in rows:
            print(f"{r['schedule']:>16}  p={r['p']} m={r['m']:<3} theory {r['theory']:.3f}  simulated "
                  f"{r['simulated']:.3f}  measured median "
                  f"{r['median']:.3f} (min {r['min']:.3f})  off by {100 * r['median_off_by']:+.1f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"backend": b.name, "delay_ms": [args.forward_ms, args.backward_ms], "rows": rows}, f, indent=2)
    b.collective.destroy()


if __name__ == "__main__":
    main()
