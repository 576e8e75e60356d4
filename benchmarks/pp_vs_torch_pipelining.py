"""chipset pipeline (pp=2, 1F1B) vs torch.distributed.pipelining's Schedule1F1B, in one run.

Same model (chipset's reference transformer, same seed), same split (embedding + first
half of the blocks on rank 0, the rest + head + loss on rank 1), same micro-batches, same
data, fp32, AdamW, no clipping (torch's pipelining has no cross-stage clipping of its
own). The two trainers alternate step by step so machine noise hits both alike; the
median step time of each is reported and their ratio (chipset / torch; below 1.00 means
chipset is faster), plus each one's per-step loss so the runs can be seen to agree.

``--size S|M|L`` picks the model of ``vs_plain_torch.py``'s sizes S and M (hidden 128 / 256,
4 blocks, sequence 128) or the larger L of issue 38 (hidden 512, 8 blocks, sequence 256);
explicit ``--hidden`` ... flags override it. ``--zero-bubble`` adds the zero-bubble
schedules as extra trainers in the same alternation: chipset's ``zero_bubble`` (ZB-H1) and
``zbv`` (4 virtual stages of a quarter of the blocks each, V-shaped), torch's
``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1; and 4 stages interleaved ranks
0,1,0,1) and ``ScheduleZBVZeroBubble`` (4 stages V-shaped 0,1,1,0), each with its own copy of
the model and optimizer; each one's median and the ratio of chipset's 1F1B to it are reported too. ``--profile`` adds each trainer's
Python function calls and CPU time per step (cProfile over 3 more steps each, after the
timed ones; CPU time under cProfile, so compare it between the trainers only). Every run
also reports each rank's median main-thread CPU time per step of each trainer (the work it
does, without the time blocked in waits: comparable on a loaded machine), its main thread's
mean minor page faults per step (memory the C allocator gave back and took again), and the
malloc settings of the environment (``CHIPSET_CPU_MALLOC``, glibc's ``MALLOC_*``).
``--trace-dir DIR`` records 3 more steps of each trainer with ``torch.profiler`` (memory
included) and writes ``DIR/<trainer>/rank{r}.json`` (chrome traces, for
``benchmarks/trace_compare.py DIR/chipset DIR/torch``) and ``DIR/<trainer>/rank{r}.txt``
(operators by self CPU time, with their call counts and bytes allocated).

``--heap-trace`` runs 3 more steps of each trainer under ``heap_trace.py``'s dispatch mode
and reports, per rank, the minor page faults per step, the operators that faulted most and
every glibc heap trim with the Python frames where it happened.

``--delay-ms F,B`` sleeps F ms after every micro-batch forward and B ms after every
backward on both sides (a stand-in for heavier compute, so the schedule rather than
Python overhead dominates).

    CHIPSET_BACKEND=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \
        benchmarks/pp_vs_torch_pipelining.py [--size S|M|L] [--steps 10] [--micro-batches 4] \
        [--zero-bubble] [--profile] [--trace-dir DIR] [--heap-trace] [--delay-ms 0,0] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import time

import torch
import torch.distributed as dist
from heap_trace import heap_trace
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

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


def zero_bubble_trainer(cfg, b, data, rank: int, m: int, style: str, loss_fn, delay):
    """One step of torch's ScheduleInterleavedZeroBubble (``style`` "loop": stages 0-3 on ranks
    0,1,0,1; "h1": one stage per rank, chipset's 1F1B split) or ScheduleZBVZeroBubble ("v": ranks
    0,1,1,0) over a fresh copy of the model."""
    model = Transformer(cfg.model, b.kernels, seed=1)
    dev = b.device.torch_device()
    n = 2 if style == "h1" else 4
    per = cfg.model.num_hidden_layers // n
    mine = (rank,) if style == "h1" else (rank, 2 + rank) if style == "loop" else (rank, 3 - rank)
    mods = [_Half(model, s * per, (s + 1) * per, s == 0, s == n - 1, delay).to(dev) for s in mine]
    stages = [PipelineStage(mod, s, n, dev) for mod, s in zip(mods, mine, strict=True)]
    kind = ScheduleZBVZeroBubble if style == "v" else ScheduleInterleavedZeroBubble
    sched = kind(stages, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for mod in mods for p in mod.parameters()], lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    holds_last = n - 1 in mine

    def step(i: int) -> float:
        tokens, targets = data.batch(i, 0, 1, device=dev)
        losses: list = []
        inputs = (tokens,) if rank == 0 else ()  # rank 0 holds stage 0 in both layouts
        if holds_last:  # stage 3: rank 1 interleaved, rank 0 under V
            sched.step(*inputs, target=targets, losses=losses)
        else:
            sched.step(*inputs)
        opt.step()
        opt.zero_grad(set_to_none=False)
        out = torch.tensor([float(sum(x.detach() for x in losses) / m) if losses else 0.0])
        dist.all_reduce(out)
        return float(out)

    return step


def profile(fn, first: int, b, steps: int = 3) -> dict:
    """Python function calls and this process's CPU time per step of ``fn`` under cProfile."""
    pr = cProfile.Profile()
    cpu = []
    for i in range(first, first + steps):
        b.collective.barrier()
        c0 = time.process_time()
        pr.enable()
        fn(i)
        pr.disable()
        cpu.append(time.process_time() - c0)
    return {"python_calls_per_step": pstats.Stats(pr).total_calls / steps,
            "cpu_s_per_step_under_cprofile": statistics.median(cpu)}


def trace(fn, first: int, b, out: str, rank: int, steps: int = 3) -> None:
    """``steps`` steps of ``fn`` under torch.profiler: a chrome trace and an operator table."""
    os.makedirs(out, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(first, first + steps):
            b.collective.barrier()
            with torch.profiler.record_function("step"):
                fn(i)
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{steps} steps\n{table}\n")


def _gather_profile(mine: dict, b) -> dict:
    """Every rank's profile numbers (``profile`` per trainer), by rank."""
    names = sorted(mine)
    vec = torch.tensor([[mine[k]["python_calls_per_step"], mine[k]["cpu_s_per_step_under_cprofile"]] for k in names],
                       dtype=torch.float64)
    rows = [torch.empty_like(vec) for _ in range(b.collective.world_size())]
    dist.all_gather(rows, vec)
    return {f"rank{r}": {k: {"python_calls_per_step": round(float(v[0])), "cpu_s_per_step_under_cprofile": float(v[1])}
                         for k, v in zip(names, row, strict=True)} for r, row in enumerate(rows)}


SIZES = {  # hidden, layers, heads, kv heads, ffn, vocab, seq (S and M as in vs_plain_torch.py)
    "S": (128, 4, 4, 2, 344, 256, 128),
    "M": (256, 4, 8, 4, 688, 1024, 128),
    "L": (512, 8, 8, 4, 1376, 4096, 256),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="model preset (flags below override)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="default 256")
    ap.add_argument("--layers", type=int, default=None, help="default 4")
    ap.add_argument("--heads", type=int, default=None, help="default 8")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--vocab", type=int, default=None, help="default 1024")
    ap.add_argument("--seq", type=int, default=None, help="default 64")
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--micro-batches", type=int, default=None, help="default 4 with --size, else 8")
    ap.add_argument("--zero-bubble", action="store_true", help="also time torch's zero-bubble schedules")
    ap.add_argument("--profile", action="store_true", help="also count Python calls and CPU time per step")
    ap.add_argument("--trace-dir", default=None, help="also write torch.profiler traces of 3 steps per trainer")
    ap.add_argument("--heap-trace", action="store_true",
                    help="also trace 3 more steps per trainer: page faults by operator, glibc heap trims")
    ap.add_argument("--delay-ms", default="0,0", help="sleep after each forward,backward (ms), both sides")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    preset = SIZES[args.size] if args.size else (256, 4, 8, None, None, 1024, 64)
    for name, value in zip(("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq"), preset, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.kv_heads = args.kv_heads or args.heads
    args.ffn = args.ffn or 4 * args.hidden
    if args.micro_batches is None:
        args.micro_batches = 4 if args.size else 8
    if args.zero_bubble and args.layers % 4:
        raise SystemExit(f"--zero-bubble cuts the model into 4 stages: --layers must be a multiple of 4, got {args.layers}")
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
                  "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                  "intermediate_size": args.ffn, "max_position_embeddings": args.seq},
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

    trainers = {"chipset": step_chipset, "torch": step_torch}
    if args.zero_bubble:
        def chipset_trainer(**parallel):
            """A step of chipset's pipeline with ``parallel`` overriding the 1F1B trainer's settings."""
            over = RunConfig.from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"], **parallel}})
            engine, engine_data, _ = build(over.validate(world_size=world), b)
            engine.compute_delay = delay

            def step_fn(step: int) -> float:
                losses = engine.forward_backward_step([engine_data.batch(step, 0, 1, i, m, device=dev)
                                                       for i in range(m)])
                engine.step(1e-3)
                return sum(losses) / m
            return step_fn

        q = args.layers // 4
        trainers["chipset_zero_bubble"] = chipset_trainer(schedule="zero_bubble")
        trainers["chipset_zbv"] = chipset_trainer(schedule="zbv", virtual_stages=2, pipeline_split=f"{q},{q},{q},{q}")
        for name, style in (("torch_zb_h1", "h1"), ("torch_interleaved_zb", "loop"), ("torch_zbv", "v")):
            trainers[name] = zero_bubble_trainer(cfg, b, data, rank, m, style, loss_fn, delay)

    names = list(trainers)
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}  # this rank's main-thread CPU seconds
    faults: dict[str, list[int]] = {k: [] for k in names}  # and its main thread's minor page faults
    losses: dict[str, list[float]] = {k: [] for k in names}
    for step in range(args.warmup + args.steps):
        order = names[step % len(names):] + names[:step % len(names)]  # each trainer leads in turn
        for name in order:
            b.collective.barrier()
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = trainers[name](step)
            b.device.synchronize()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if step >= args.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
                faults[name].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Main-thread CPU time per step on each rank: the work a trainer does, without its waits
    # (a blocked receive costs no CPU), so it stays comparable on a loaded machine.
    mine_cpu = torch.tensor([[statistics.median(cpu[k]), statistics.mean(faults[k])] for k in names],
                            dtype=torch.float64)
    rows = [torch.empty_like(mine_cpu) for _ in range(world)]
    dist.all_gather(rows, mine_cpu)
    result = {
        "backend": b.name, "world_size": world, "micro_batches": m, "steps": args.steps,
        "model": {k: getattr(args, k) for k in ("size", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab",
                                                "seq", "batch")},
        "delay_ms": args.delay_ms, "params": sum(p.numel() for p in ref_model.parameters()),
        "median_step_s": med, "ratio_step_time_chipset_over_torch": med["chipset"] / med["torch"],
        "median_main_thread_cpu_s": {f"rank{r}": dict(zip(names, row[:, 0].tolist(), strict=True))
                                     for r, row in enumerate(rows)},
        "mean_minor_faults_per_step": {f"rank{r}": dict(zip(names, row[:, 1].round().tolist(), strict=True))
                                       for r, row in enumerate(rows)},
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "CHIPSET_CPU_MALLOC"},
        "losses": losses,
    }
    if args.zero_bubble:
        result["ratio_step_time_chipset_over"] = {k: med["chipset"] / med[k] for k in names if k != "chipset"}
    if args.profile:
        result["profile"] = _gather_profile({k: profile(trainers[k], args.warmup + args.steps, b) for k in names}, b)
    if args.heap_trace:
        traced = {k: heap_trace(trainers[k], args.warmup + args.steps + 6, barrier=b.collective.barrier) for k in names}
        everyone = [None] * world
        dist.all_gather_object(everyone, traced)
        result["heap_trace"] = {f"rank{r}": t for r, t in enumerate(everyone)}
    if args.trace_dir:
        for k in names:
            trace(trainers[k], args.warmup + args.steps + 3, b, os.path.join(args.trace_dir, k), rank)
    if rank == 0:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    b.collective.destroy()


if __name__ == "__main__":
    main()
