"""What cpu_sim's per-op memory accounting costs in a training step.

One process on cpu_sim builds the engine of ``chipset train`` (DataParallel, one rank)
and alternates steps with the accounting dispatch mode active and popped off the mode
stack (the counters go stale while it is off; only time is measured). Prints the median
step time of each and the overhead, ``on / off - 1``, in wall time and in this process's
CPU time (``time.process_time``: what the step itself burned, which other processes
competing for the cores inflate far less), and the median over step pairs of one
accounted step against the unaccounted step after it (``overhead_paired_cpu_time``).
Alternating step by step keeps slow drifts of the load out of the ratio.

    OMP_NUM_THREADS=1 python benchmarks/sim_accounting_overhead.py [--steps 20] \\
        [--hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 344 --vocab 256 --seq 128 --batch 16]

``--per-op`` instead times one allocating op and one view (``z = x.add(y); z.view(8, 8)``
on 64 floats) 20,000 times: with the accounting on, off, and under a dispatch mode that
does nothing but call the op (torch's own cost of a Python dispatch mode: the floor any
per-op accounting in Python pays). Best of 5 rounds each, in microseconds per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from chipset.data.datasets import SyntheticTokens
from chipset.loader import backend
from chipset.models import Transformer
from chipset.parallel.dims import ParallelDims
from chipset.runtime.data_parallel import DataParallel
from chipset.train.config import RunConfig


def per_op(mode) -> dict:
    """Microseconds per (allocating op + view): accounting on, off, and a do-nothing mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Noop(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(64), torch.randn(64)

    def best(n: int = 20000) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                x.add(y).view(8, 8)
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return min(runs)

    best(2000)
    on = best()
    mode.__exit__(None, None, None)
    off = best()
    with Noop():
        noop = best()
    mode.__enter__()
    return {"us_per_pair": {"accounting": on, "off": off, "noop_mode": noop},
            "accounting_us": on - off, "torch_mode_floor_us": noop - off, "tracker_own_us": on - noop}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-op", action="store_true", help="time one op pair instead of training steps")
    for name, default in (("hidden", 128), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("ffn", 344),
                          ("vocab", 256), ("seq", 128), ("batch", 16), ("steps", 20), ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    os.environ.update(CHIPSET_BACKEND="cpu_sim", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1")
    b = backend("cpu_sim")
    b.device.set_device(0)
    b.collective.init_process_group()
    mode = b.memory._mode  # the accounting TorchDispatchMode, entered by set_device
    if a.per_op:
        print(json.dumps(per_op(mode), indent=2))
        b.collective.destroy()
        return
    cfg = RunConfig.from_dict({"model": {
        "vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "intermediate_size": a.ffn,
        "max_position_embeddings": a.seq}})
    engine = DataParallel(Transformer(cfg.model, b.kernels, seed=1), b, ParallelDims(dp=1, world_size=1),
                          grad_clip=1.0)
    data = SyntheticTokens(a.vocab, a.seq, a.batch, seed=0)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    on = True
    for i in range(a.warmup + 2 * a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens, targets = data.batch(i, 0, 1)
        engine.forward_backward(tokens, targets)
        engine.step(1e-3)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= a.warmup:
            times["on" if on else "off"].append(dt)
            cpu["on" if on else "off"].append(dc)
        # Toggle for the next step.
        if on:
            mode.__exit__(None, None, None)
        else:
            mode.__enter__()
        on = not on
    if not on:
        mode.__enter__()
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each accounted step against the unaccounted step right after it: slow drifts of the
    # machine's speed (load, clock) cancel within a pair.
    paired = statistics.median(a / b - 1 for a, b in zip(cpu["on"], cpu["off"], strict=True))
    medc = {k: statistics.median(v) for k, v in cpu.items()}
    print(json.dumps({"median_step_s": med, "overhead": med["on"] / med["off"] - 1,
                      "median_step_cpu_s": medc, "overhead_cpu_time": medc["on"] / medc["off"] - 1,
                      "overhead_min_cpu_time": min(cpu["on"]) / min(cpu["off"]) - 1,
                      "overhead_paired_cpu_time": paired,
                      "tokens_per_step": a.batch * a.seq, "steps_each": a.steps}, indent=2))
    b.collective.destroy()


if __name__ == "__main__":
    main()
