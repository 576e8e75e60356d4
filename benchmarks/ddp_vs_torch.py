"""chipset data parallel vs torch DistributedDataParallel: step time ratio, interleaved in one run.

Same model (chipset's reference transformer), same data, same backend, same world size,
fp32, AdamW, clipping at 1.0. The two trainers alternate step by step so machine noise
hits both alike; the median step time of each is reported and their ratio
(chipset / DDP; below 1.00 means chipset is faster).

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/ddp_vs_torch.py \
        [--steps 20] [--hidden 256] [--layers 4] [--seq 64] [--batch 16] [--zero 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from chipset.config import RunConfig
from chipset.engine import DataParallel, ParallelDims, SyntheticTokens
from chipset.loader import backend
from chipset.models import Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--zero", type=int, default=0)
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

    mine = DataParallel(Transformer(cfg.model, b.kernels, seed=1), b,
                        ParallelDims(dp=world, zero=args.zero, world_size=world),
                        bucket_mb=args.bucket_mb, grad_clip=1.0, betas=(0.9, 0.95))
    ref_model = Transformer(cfg.model, b.kernels, seed=1).to(dev)
    ddp = DistributedDataParallel(ref_model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step_chipset(step: int) -> float:
        tokens, targets = data.batch(step, rank, world, device=dev)
        loss = mine.forward_backward(tokens, targets)
        mine.step(1e-3)
        return loss

    def step_ddp(step: int) -> float:
        tokens, targets = data.batch(step, rank, world, device=dev)
        loss = _ddp_loss(ddp, tokens, targets, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    times: dict[str, list[float]] = {"chipset": [], "ddp": []}
    losses: dict[str, list[float]] = {"chipset": [], "ddp": []}
    for step in range(args.warmup + args.steps):
        order = [("chipset", step_chipset), ("ddp", step_ddp)]
        if step % 2:
            order.reverse()
        for name, fn in order:
            b.collective.barrier()
            t0 = time.perf_counter()
            loss = fn(step)
            b.device.synchronize()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "world_size": world, "backend": b.name, "zero": args.zero, "steps": args.steps,
        "params": sum(p.numel() for p in ref_model.parameters()),
        "median_step_s": med, "ratio_chipset_over_ddp": med["chipset"] / med["ddp"],
        "final_loss": {k: v[-1] for k, v in losses.items()},
    }
    if rank == 0:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    b.collective.destroy()


def _ddp_loss(ddp, tokens, targets, b):
    # DDP hooks run on ddp.forward; compute logits through it, then the same loss kernel.
    logits = ddp(tokens)
    return b.kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


if __name__ == "__main__":
    main()
