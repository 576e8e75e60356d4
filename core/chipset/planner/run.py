"""An engine run config as the planner sees it: model, layout and train spec, and per-rank peak memory.

Read by attribute, so the planner never imports the engine's config (a ``chipset.config.RunConfig``
or anything shaped like it: ``.model``, ``.parallel``, ``.train``). The engine's optimizer keeps
float32 master weights except where the parameters already are them (float32 compute under ZeRO 0
and 3, ``engine/data_parallel.py``), so the optimizer bytes per parameter (ZeRO's K) are 8 there
and 12 elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import MemoryBreakdown, memory_per_stage
from chipset.planner.model import ModelSpec, from_engine_model_config

__all__ = ["from_run_config", "peak_memory_per_rank", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved_1f1b": "interleaved"}


def from_run_config(cfg: Any, world_size: int | None = None,
                    kernels: str = "reference") -> tuple[ModelSpec, Layout, TrainSpec]:
    """(model, layout, train) for an engine config; ``kernels``: "reference" (cpu_sim) or "fused".

    ``parallel.dp = 0`` (fill from the world size) needs ``world_size``.
    """
    par, tr = cfg.parallel, cfg.train
    dp = par.dp or (world_size or 0) // (par.tp * par.pp * par.cp)
    if dp < 1:
        raise ValueError(f"parallel.dp is 0 and world_size {world_size!r} does not give a degree; pass world_size")
    # The engine replicates experts over tp (docs/engine.md, "MoE with tp, cp and pp").
    m = dataclasses.replace(from_engine_model_config(cfg.model, tr.seq_len), kernels=kernels,
                            flash_attention=kernels != "reference", experts_split_over_tp=False)
    e = DTYPE_BYTES[tr.dtype]
    masters_are_params = tr.dtype == "float32" and par.zero in (0, 3) and not par.offload_optimizer
    lay = Layout(dp=dp, tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, zero=par.zero,
                 micro_batch=tr.global_batch // (dp * par.micro_batches),
                 schedule=_SCHEDULES.get(par.schedule, par.schedule), virtual_stages=par.virtual_stages,
                 recompute=tr.recompute, sequence_parallel=par.sequence_parallel,
                 cp_attention=getattr(par, "cp_attention", "allgather"))
    train = TrainSpec(global_batch=tr.global_batch, dtype=tr.dtype, param_bytes=e, grad_bytes=e,
                      optimizer_bytes=8 if masters_are_params else 12, bucket_mb=par.bucket_mb)
    return m, lay.check(), train


def peak_memory_per_rank(cfg: Any, world_size: int | None = None,
                         kernels: str = "reference") -> list[MemoryBreakdown]:
    """Predicted peak device memory of every rank (rank order of ``engine/parallel_dims.py``: pp outermost)."""
    m, lay, train = from_run_config(cfg, world_size, kernels)
    stages = memory_per_stage(m, lay, train, cfg.train.seq_len)
    per_stage = lay.world_size // lay.pp
    out = []
    for rank in range(lay.world_size):
        idx = rank // per_stage
        key = "only" if lay.pp == 1 else "first" if idx == 0 else "last" if idx == lay.pp - 1 else "first"
        out.append(stages[key])
    return out
