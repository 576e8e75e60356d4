"""Your own training loop on chipset's engine (docs/library.md). From the repository root:

    torchrun --nproc-per-node 2 examples/custom_loop.py      # or: python examples/custom_loop.py
    torchrun --nproc-per-node 2 examples/custom_loop.py parallel.tp=2 parallel.zero=0

Arguments are config overrides (``section.key=value``, as ``chipset train --set`` takes them).
"""

import sys

import torch
from torch import nn

from chipset import api

cfg = api.config(overrides=["parallel.zero=3", "train.steps=8", "train.global_batch=16", "train.lr=0.01",
                            "train.checkpoint_every=4", *sys.argv[1:]])
backend = api.init(cfg)  # backend, this rank's device, the process group (torchrun's or a world of one)
torch.manual_seed(cfg.train.seed)  # rank 0's weights go to every rank anyway
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
engine = api.parallelize(cfg, backend, model, plan={"0": "colwise", "2": "rowwise"})  # plan: for tp
ckpt = api.checkpointer(cfg, backend, engine, "runs/custom-loop")
start = ckpt.resume("auto")  # 0 for a fresh run directory
teacher = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
dp_rank, dp = engine.dims.coords(backend.collective.rank())["dp"], engine.dims.dp
for step in range(start, cfg.train.steps):
    x = torch.randn(cfg.train.global_batch, 16, generator=torch.Generator().manual_seed(step))
    x = x.chunk(dp)[dp_rank].to(engine.device)  # this rank's share of the global batch
    loss, stats = api.step(engine, [(x, (x @ teacher.T.to(x.device)).argmax(-1))], api.lr_at(cfg, step))
    if backend.collective.rank() == 0:
        print(f"step {step + 1} loss {loss:.9g} grad_norm {stats['grad_norm']:.4g}", flush=True)
    if ckpt.due(step + 1):
        ckpt.save(step + 1)
ckpt.finish()
api.finish_rank(backend)
