"""A plain PyTorch trainer of chipset's reference architecture, without chipset.

The honest peer of ``chipset train`` in benchmarks/vs_plain_torch.py: the same decoder
(RMSNorm, rotary, grouped-query causal attention, SwiGLU, untied head) built only from
stock torch parts (``nn.Embedding``, ``nn.Linear``, ``nn.RMSNorm``,
``F.scaled_dot_product_attention``, ``F.cross_entropy``, ``torch.optim.AdamW(fused=True)``,
``clip_grad_norm_``), trained by one of torch's own parallel wrappers:

- ``--mode ddp``: ``DistributedDataParallel``;
- ``--mode fsdp2``: ``fully_shard`` on every block and the root (ZeRO-3);
- ``--mode pp``: ``torch.distributed.pipelining``, two stages (embedding + first half of
  the blocks; the rest + norm + head + loss), ``Schedule1F1B`` over ``--micro-batches``,
  the global gradient norm summed over both stages before clipping (as chipset does).

It never imports chipset. Rank 0 prints one JSON line: tokens/s over the steps after the
first (steady state, as ``chipset train`` reports it) and each rank's peak resident memory
over the step loop (``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

    torchrun --standalone --nproc-per-node=2 benchmarks/plain_torch_lm.py --mode ddp \\
        --hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 344 --vocab 256 --seq 128 --batch 16 --steps 10

``--profile-steps A:B --trace-dir DIR`` records steps A..B (1-based, inclusive) with
``torch.profiler`` and writes each rank's chrome trace to ``DIR/rank{r}.json``, the same
file layout as ``chipset train --set train.profile_steps=A:B`` (benchmarks/trace_compare.py
reads both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float(), ang.sin().float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        h, hd = a.hidden, a.hidden // a.heads
        self.heads, self.kv, self.hd = a.heads, a.kv_heads, hd
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)
        self.q = nn.Linear(h, a.heads * hd, bias=False)
        self.k = nn.Linear(h, a.kv_heads * hd, bias=False)
        self.v = nn.Linear(h, a.kv_heads * hd, bias=False)
        self.o = nn.Linear(a.heads * hd, h, bias=False)
        self.gate = nn.Linear(h, a.ffn, bias=False)
        self.up = nn.Linear(h, a.ffn, bias=False)
        self.down = nn.Linear(a.ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True,
                                             enable_gqa=self.kv != self.heads)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Stage(nn.Module):
    """Blocks ``[lo, hi)``, with the embedding when ``first`` and norm + head when ``last``."""

    def __init__(self, a, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden) if first else None
        self.blocks = nn.ModuleList(Block(a) for _ in range(lo, hi))
        self.norm = nn.RMSNorm(a.hidden, eps=1e-6) if last else None
        self.head = nn.Linear(a.hidden, a.vocab, bias=False) if last else None
        cos, sin = rope_tables(a.seq, a.hidden // a.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        s = x.shape[1]
        for blk in self.blocks:
            x = blk(x, self.cos[:s], self.sin[:s])
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def peak_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ddp", "fsdp2", "pp"), default="ddp")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=344)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--profile-steps", default="", help="A:B, 1-based steps to record with torch.profiler")
    ap.add_argument("--trace-dir", default="traces", help="where each rank's chrome trace goes")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    pp = a.mode == "pp"
    if pp:
        half = a.layers // 2
        model = Stage(a, 0, half, True, False) if rank == 0 else Stage(a, half, a.layers, False, True)
    else:
        model = Stage(a, 0, a.layers, True, True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)

    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif a.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    local = a.batch if pp else a.batch // world  # sequences this rank feeds per step
    g = torch.Generator().manual_seed(7 + (0 if pp else rank))
    if pp:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, a.micro_batches, loss_fn=loss_fn)

    def step() -> None:
        data = torch.randint(a.vocab, (local, a.seq + 1), generator=g)
        tokens, targets = data[:, :-1], data[:, 1:]
        if pp:
            if rank == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets)
            params = [p for p in model.parameters() if p.grad is not None]
            sq = torch.stack([p.grad.pow(2).sum() for p in params]).sum().reshape(1)
            dist.all_reduce(sq)  # the global norm over both stages
            coef = 1.0 / max(1.0, math.sqrt(float(sq)))
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in params], coef)
        else:
            for m in range(a.micro_batches):
                mb = slice(m * local // a.micro_batches, (m + 1) * local // a.micro_batches)
                sync = m == a.micro_batches - 1 or a.mode != "ddp"
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = loss_fn(model(tokens[mb]), targets[mb]) / a.micro_batches
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    dist.barrier()
    peak_reset()
    times = []
    first, last = (int(x) for x in a.profile_steps.split(":")) if a.profile_steps else (0, -1)
    prof = None
    for i in range(1, a.steps + 1):
        if i == first:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"ProfilerStep#{i}") if prof else contextlib.nullcontext():
            step()
        times.append(time.perf_counter() - t0)
        if prof is not None and i == last:
            prof.__exit__(None, None, None)
            os.makedirs(a.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(a.trace_dir, f"rank{rank}.json"))
            prof = None
    peaks = torch.zeros(world, dtype=torch.float64)
    peaks[rank] = peak_rss()
    dist.all_reduce(peaks)
    steady = times[1:] or times
    if rank == 0:
        print(json.dumps({"mode": a.mode, "world": world, "tokens_per_s": a.batch * a.seq * len(steady) / sum(steady),
                          "peak_rss_bytes": [int(x) for x in peaks.tolist()]}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
