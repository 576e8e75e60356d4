"""What cpu_sim's per-op memory accounting costs in a training step.

One process on cpu_sim builds the engine of ``chipset train`` (DataParallel, one rank)
and alternates steps with the accounting dispatch mode active and popped off the mode
stack (the counters go stale while it is off; only time is measured). Prints the median
step time of each and the overhead, ``on / off - 1``, in wall time and in this process's
CPU time (``time.process_time``: what the step itself burned, which other processes
competing for the cores inflate far less). Alternating step by step keeps slow drifts
of the load out of the ratio.

    OMP_NUM_THREADS=1 python benchmarks/sim_accounting_overhead.py [--steps 20] \\
        [--hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 344 --vocab 256 --seq 128 --batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from chipset.config import RunConfig
from chipset.engine import DataParallel, ParallelDims, SyntheticTokens
from chipset.loader import backend
from chipset.models import Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("hidden", 128), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("ffn", 344),
                          ("vocab", 256), ("seq", 128), ("batch", 16), ("steps", 20), ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    os.environ.update(CHIPSET_BACKEND="cpu_sim", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1")
    b = backend("cpu_sim")
    b.device.set_device(0)
    b.collective.init_process_group()
    mode = b.memory._mode  # the accounting TorchDispatchMode, entered by set_device
    cfg = RunConfig.from_dict({"model": {
        "vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "intermediate_size": a.ffn,
        "max_position_embeddings": a.seq}})
    engine = DataParallel(Transformer(cfg.model, b.kernels, seed=1), b, ParallelDims(dp=1, world_size=1),
                          grad_clip=1.0, betas=(0.9, 0.95))
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
    medc = {k: statistics.median(v) for k, v in cpu.items()}
    print(json.dumps({"median_step_s": med, "overhead": med["on"] / med["off"] - 1,
                      "median_step_cpu_s": medc, "overhead_cpu_time": medc["on"] / medc["off"] - 1,
                      "overhead_min_cpu_time": min(cpu["on"]) / min(cpu["off"]) - 1,
                      "tokens_per_step": a.batch * a.seq, "steps_each": a.steps}, indent=2))
    b.collective.destroy()


if __name__ == "__main__":
    main()
