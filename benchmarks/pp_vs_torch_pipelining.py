"""chipset pipeline (pp=2, 1F1B) vs torch.distributed.pipelining's Schedule1F1B, in one run.

Same model (chipset's reference transformer, same seed), same split (embedding + first
half of the blocks on rank 0, the rest + head + loss on rank 1), same micro-batches, same
data, fp32, AdamW, no clipping (torch's pipelining has no cross-stage clipping of its
own). The two trainers alternate step by step so machine noise hits both alike; the
median step time of each is reported and their ratio (chipset / torch; below 1.00 means
chipset is faster), plus each one's per-step loss so the runs can be seen to agree.

``--delay-ms F,B`` sleeps F ms after every micro-batch forward and B ms after every
backward on both sides (a stand-in for heavier compute, so the schedule rather than
Python overhead dominates).

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/pp_vs_torch_pipelining.py \
        [--steps 10] [--hidden 256] [--layers 4] [--seq 64] [--batch 16] [--micro-batches 8] \
        [--delay-ms 0,0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from chipset.loader import backend
from chipset.models import Transformer
from chipset.train import build
from chipset.train.config import RunConfig


class _Half(nn.Module):
    """One torch pipelining stage: the blocks [lo, hi) of the model, with the embedding or head."""

    def __init__(self, model: Transformer, lo: int, hi: int, first: bool, last: bool, delay: tuple[float, float]):
        super().__init__()
        self.embed = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.head = model.head if last else None
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers:  # each block reads its rotary tables from the model's Rotary
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        if self.delay[0]:
            time.sleep(self.delay[0])
        if self.delay[1] and x.requires_grad:
            x.register_hook(lambda g: (time.sleep(self.delay[1]), g)[1])
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--delay-ms", default="0,0", help="sleep after each forward,backward (ms), both sides")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    delay = tuple(float(x) / 1000 for x in args.delay_ms.split(","))

    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    world, rank = b.collective.world_size(), b.collective.rank()
    if world != 2:
        raise SystemExit(f"run with 2 ranks (pp=2), found {world}")
    m, half = args.micro_batches, args.layers // 2
    cfg = RunConfig.from_dict({
        "model": {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                  "num_attention_heads": 8, "intermediate_size": 4 * args.hidden,
                  "max_position_embeddings": args.seq},
        "train": {"global_batch": args.batch, "seq_len": args.seq, "grad_clip": 0.0, "lr": 1e-3, "seed": 1},
        "parallel": {"pp": 2, "schedule": "1f1b", "micro_batches": m,
                     "pipeline_split": f"{half},{args.layers - half}"},
    }).validate(world_size=world)
    dev = b.device.torch_device()

    mine, data, _ = build(cfg, b)
    mine.compute_delay = delay

    ref_model = Transformer(cfg.model, b.kernels, seed=1)
    first, last = rank == 0, rank == 1
    stage_mod = _Half(ref_model, 0 if first else half, half if first else args.layers, first, last, delay).to(dev)
    stage = PipelineStage(stage_mod, rank, 2, dev)

    def loss_fn(logits, targets):
        return b.kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    sched = Schedule1F1B(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step_chipset(step: int) -> float:
        batches = [data.batch(step, 0, 1, i, m, device=dev) for i in range(m)]
        losses = mine.forward_backward_step(batches)
        mine.step(1e-3)
        return sum(losses) / m

    def step_torch(step: int) -> float:
        tokens, targets = data.batch(step, 0, 1, device=dev)
        losses: list = []
        if first:
            sched.step(tokens)
        else:
            sched.step(target=targets, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=False)
        out = torch.tensor([float(sum(x.detach() for x in losses) / m) if losses else 0.0])
        dist.all_reduce(out)  # the loss lives on the last stage
        return float(out)

    times: dict[str, list[float]] = {"chipset": [], "torch": []}
    losses: dict[str, list[float]] = {"chipset": [], "torch": []}
    for step in range(args.warmup + args.steps):
        order = [("chipset", step_chipset), ("torch", step_torch)]
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
        "backend": b.name, "world_size": world, "micro_batches": m, "steps": args.steps,
        "delay_ms": args.delay_ms, "params": sum(p.numel() for p in ref_model.parameters()),
        "median_step_s": med, "ratio_step_time_chipset_over_torch": med["chipset"] / med["torch"],
        "losses": losses,
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
