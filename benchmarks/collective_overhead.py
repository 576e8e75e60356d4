"""cpu_sim collective accounting overhead vs raw gloo all_reduce, as a ratio measured in one run.

    python benchmarks/collective_overhead.py [--world 2] [--iters 40] [--sizes-mib 1 4 16]

Starts ``--world`` processes over loopback gloo. In one process group, each rank
alternates a raw ``torch.distributed.all_reduce`` and cpu_sim's
``SimCollective.all_reduce`` (accounting + fault hooks) on the same tensor, with a
barrier before every timed op so both ranks start together (the order flips every
iteration). Rank 0 prints, per size, the median time of each path and two ratios:
``ratio`` = median over iterations of the paired ratio sim_i / raw_i (adjacent pairs
cancel the load drift of a shared machine) and ``min ratio`` = min(sim) / min(raw).
It also measures the wrapper's own cost directly (``_run`` around a no-op, 5000 calls)
and prints the ratio that cost implies at each size. The memory tracker is not bound
(no ``set_device``), so only the collective wrapper is measured.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _worker(iters: int, sizes_mib: list[float]) -> None:
    import torch
    import torch.distributed as dist

    import chipset

    c = chipset.backend("cpu_sim").collective
    c.init_process_group()
    rank = c.rank()
    rows = []
    for mib in sizes_mib:
        x = torch.ones(int(mib * 2**20) // 4)
        for _ in range(3):  # warm-up both paths
            dist.all_reduce(x)
            c.all_reduce(x)
        raw, sim = [], []
        for i in range(iters):
            order = (("raw", "sim") if i % 2 == 0 else ("sim", "raw"))
            for which in order:
                dist.barrier()
                t0 = time.perf_counter()
                if which == "raw":
                    dist.all_reduce(x)
                else:
                    c.all_reduce(x)
                (raw if which == "raw" else sim).append(time.perf_counter() - t0)
        paired = statistics.median(s_ / r_ for r_, s_ in zip(raw, sim, strict=True))
        rows.append((mib, statistics.median(raw), statistics.median(sim), paired, min(sim) / min(raw)))
    # The wrapper's own cost: everything SimCollective adds around the c10d call.
    g = c.world
    noop = lambda: None  # noqa: E731
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            c._run("all_reduce", g, [x], noop, False)
        t1 = time.perf_counter()
        for _ in range(1000):
            noop()
        t2 = time.perf_counter()
        samples.append(((t1 - t0) - (t2 - t1)) / 1000)
    wrapper = statistics.median(samples)
    if rank == 0:
        world = c.world_size()
        print(f"cpu_sim all_reduce vs raw gloo all_reduce ({world} ranks, {iters} iterations per path, one run)")
        print(f"{'size':>8} {'raw ms':>9} {'cpu_sim ms':>11} {'ratio':>7} {'min ratio':>10} {'wrapper-cost ratio':>19}")
        for mib, r, s_, paired, mins in rows:
            print(f"{mib:>6g}Mi {r * 1e3:>9.3f} {s_ * 1e3:>11.3f} {paired:>7.3f} {mins:>10.3f} {(r + wrapper) / r:>19.4f}")
        print(f"wrapper cost per call: {wrapper * 1e6:.1f} us (accounting + fault hooks, measured around a no-op)")
    sys.stdout.flush()
    c.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        _worker(args.iters, args.sizes_mib)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = {k: v for k, v in os.environ.items() if k != "CHIPSET_SIM_FAULTS"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world),
                   CHIPSET_BACKEND="cpu_sim")
        cmd = [sys.executable, "-W", "ignore", __file__, "--_worker", "--iters", str(args.iters),
               "--sizes-mib", *map(str, args.sizes_mib)]
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
