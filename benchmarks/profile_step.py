"""Where one chipset training step spends its time: torch.profiler's top ops, one process.

Builds the engine of ``chipset train`` (DataParallel over one rank) on the selected backend
(``CHIPSET_BACKEND``), runs warm-up steps, then profiles ``--steps`` steps and prints the
top operators by self CPU time plus the median step time. Used for the before/after
breakdown in docs/benchmarks.md ("Engine overhead").

    OMP_NUM_THREADS=1 CHIPSET_BACKEND=cpu_sim python benchmarks/profile_step.py \
        [--hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 344 --vocab 256 --seq 128 --batch 16] [--top 15] \
        [--reference]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from chipset.data.datasets import SyntheticTokens
from chipset.loader import backend
from chipset.models import Transformer
from chipset.parallel.dims import ParallelDims
from chipset.runtime.data_parallel import DataParallel
from chipset.train.config import RunConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=344)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--reference", action="store_true",
                    help="drop the backend's registered kernels: every kernel runs the core reference")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    b = backend()
    b.device.set_device(0)
    b.collective.init_process_group()
    if args.reference:
        b.kernels._impls.clear()
    cfg = RunConfig.from_dict({"model": {
        "vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.ffn, "max_position_embeddings": args.seq}})
    engine = DataParallel(Transformer(cfg.model, b.kernels, seed=1), b, ParallelDims(dp=1, world_size=1),
                          grad_clip=1.0)
    data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=0)
    dev = b.device.torch_device()

    def step(i: int) -> None:
        tokens, targets = data.batch(i, 0, 1, device=dev)
        engine.forward_backward(tokens, targets)
        engine.step(1e-3)

    for i in range(args.warmup):
        step(i)
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            t0 = time.perf_counter()
            step(args.warmup + i)
            times.append(time.perf_counter() - t0)
    print(f"backend {b.name}{' (reference kernels)' if args.reference else ''}: median step {statistics.median(times) * 1e3:.1f} ms over {args.steps} "
          f"(under the profiler), {args.batch * args.seq / statistics.median(times):.0f} tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                    max_name_column_width=40))
    b.collective.destroy()


if __name__ == "__main__":
    main()
