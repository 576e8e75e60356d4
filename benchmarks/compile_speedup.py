"""``train.compile = true`` vs eager: ``chipset train`` (2 ranks, ``--backend``) with and without per-block torch.compile.

The two variants alternate job by job (eager first on even repetitions). Each job reports
steady tokens/s (steps after the first, as ``chipset train`` does), the first step's
time (which holds the compile under ``train.compile``) and the largest rank's peak memory;
the table gives medians and the ratios compiled / eager. Layouts and sizes as in
benchmarks/vs_plain_torch.py, whose ``run_chipset`` runs each job.

    python benchmarks/compile_speedup.py [--sizes S,M] [--layouts dp] [--reps 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_plain_torch import run_chipset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="S")
    ap.add_argument("--layouts", default="dp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pp-micro-batches", type=int, default=4)
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args()
    for size in a.sizes.split(","):
        for layout in a.layouts.split(","):
            got: dict[bool, list[dict]] = {False: [], True: []}
            loads = []
            for rep in range(a.reps):
                for comp in ((False, True) if rep % 2 == 0 else (True, False)):
                    a.compile = comp
                    loads.append(os.getloadavg()[0])
                    got[comp].append(run_chipset(size, layout, a))
            med = {c: {m: statistics.median(x[m] for x in v) for m in v[0]} for c, v in got.items()}
            e, c = med[False], med[True]
            print(f"{size} {layout:6} eager {e['tokens_per_s']:8.0f} tok/s first step {e['first_step_s']:6.2f} s "
                  f"{e['peak_rss_bytes'] / 2**20:6.1f} MiB | compiled {c['tokens_per_s']:8.0f} tok/s first step "
                  f"{c['first_step_s']:6.2f} s {c['peak_rss_bytes'] / 2**20:6.1f} MiB | speed-up "
                  f"{c['tokens_per_s'] / e['tokens_per_s']:.2f}x, memory {c['peak_rss_bytes'] / e['peak_rss_bytes']:.2f}x "
                  f"(load {min(loads):.1f}-{max(loads):.1f}; tok/s eager {[round(x['tokens_per_s']) for x in got[False]]}, "
                  f"compiled {[round(x['tokens_per_s']) for x in got[True]]}; first step compiled "
                  f"{[round(x['first_step_s'], 1) for x in got[True]]} s)", flush=True)


if __name__ == "__main__":
    main()
