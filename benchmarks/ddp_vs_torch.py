"""chipset data parallel vs torch's own: step time and memory ratios, interleaved in one run.

``--against ddp`` (default): chipset DP (``--zero``, default 0) vs DistributedDataParallel.
``--against fsdp2``: chipset ZeRO-3 vs FSDP2 (``fully_shard`` per block and on the root).

Same model (chipset's reference transformer), same data, same backend, same world size,
fp32, AdamW, clipping at 1.0. The two trainers alternate step by step so machine noise
hits both alike; the median step time of each is reported and their ratio
(chipset / torch; below 1.00 means chipset is faster). Memory per rank: bytes each
trainer holds between steps (parameters, gradients, optimizer state; measured by
``backend.memory.stats()`` when it is built and after its first step) plus its transient
peak during a step.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/ddp_vs_torch.py \
        [--against ddp|fsdp2] [--steps 20] [--hidden 256] [--layers 4] [--seq 64] [--batch 16] \
        [--zero 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from chipset.data.datasets import SyntheticTokens
from chipset.loader import backend
from chipset.models import Transformer
from chipset.parallel.dims import ParallelDims
from chipset.runtime.data_parallel import DataParallel
from chipset.train.config import RunConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--against", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--zero", type=int, default=None, help="chipset ZeRO stage (default 0 vs ddp, 3 vs fsdp2)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    world, rank = b.collective.world_size(), b.collective.rank()
    cfg = RunConfig.from_dict({"model": {"vocab_size": args.vocab, "hidden_size": args.hidden,
                                         "num_hidden_layers": args.layers, "num_attention_heads": 8,
                                         "intermediate_size": 4 * args.hidden, "max_position_embeddings": args.seq}})
    dev = b.device.torch_device()
    data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=0)

    zero = args.zero if args.zero is not None else (3 if args.against == "fsdp2" else 0)
    mem = b.memory

    def held() -> int:
        gc.collect()
        return mem.stats().allocated

    base = held()
    mine = DataParallel(Transformer(cfg.model, b.kernels, seed=1), b,
                        ParallelDims(dp=world, zero=zero, world_size=world),
                        bucket_mb=args.bucket_mb, grad_clip=1.0)
    mid = held()
    ref_model = Transformer(cfg.model, b.kernels, seed=1).to(dev)
    if args.against == "ddp":
        theirs = DistributedDataParallel(ref_model, bucket_cap_mb=args.bucket_mb)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(b.device.device_type, (world,))
        for block in ref_model.layers:
            fully_shard(block, mesh=mesh)
        theirs = fully_shard(ref_model, mesh=mesh)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    persistent = {"chipset": mid - base, "torch": held() - mid}

    def step_chipset(step: int) -> float:
        tokens, targets = data.batch(step, rank, world, device=dev)
        loss = mine.forward_backward(tokens, targets)
        mine.step(1e-3)
        return loss

    def step_torch(step: int) -> float:
        tokens, targets = data.batch(step, rank, world, device=dev)
        logits = theirs(tokens)  # through the wrapper, so its hooks run
        loss = b.kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    times: dict[str, list[float]] = {"chipset": [], "torch": []}
    losses: dict[str, list[float]] = {"chipset": [], "torch": []}
    transient = {"chipset": 0, "torch": 0}
    for step in range(args.warmup + args.steps):
        order = [("chipset", step_chipset), ("torch", step_torch)]
        if step % 2:
            order.reverse()
        for name, fn in order:
            b.collective.barrier()
            before = held()
            mem.reset_peak_stats()
            t0 = time.perf_counter()
            loss = fn(step)
            b.device.synchronize()
            dt = time.perf_counter() - t0
            transient[name] = max(transient[name], mem.stats().peak_allocated - before)
            if step == 0:  # optimizer state appears at the first step
                persistent[name] += held() - before
            if step >= args.warmup:
                times[name].append(dt)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = {k: persistent[k] + transient[k] for k in persistent}
    result = {
        "against": args.against, "world_size": world, "backend": b.name, "chipset_zero": zero,
        "steps": args.steps, "params": sum(p.numel() for p in Transformer(cfg.model, b.kernels).parameters()),
        "median_step_s": med, "ratio_step_time_chipset_over_torch": med["chipset"] / med["torch"],
        "peak_memory_bytes_per_rank": peak, "held_between_steps_bytes": persistent, "transient_peak_bytes": transient, "ratio_memory_chipset_over_torch": peak["chipset"] / peak["torch"],
        "final_loss": {k: v[-1] for k, v in losses.items()},
    }
    if rank == 0:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    b.collective.destroy()


if __name__ == "__main__":
    main()
