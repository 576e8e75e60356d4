"""An engine run config as the planner sees it: model, layout and train spec, and per-rank peak memory.

Read by attribute, so the planner never imports the engine's config (a ``chipset.train.config.RunConfig``
or anything shaped like it: ``.model``, ``.parallel``, ``.train``). The engine's optimizer keeps
float32 master weights except where the parameters already are them (float32 compute under ZeRO 0
and 3, ``runtime/data_parallel.py``), plus the float32 state tensors its optimizer declares
(``runtime/optim.py``): ZeRO's K is 8 there and 12 elsewhere for AdamW, 4 and 8 for SGD with momentum;
8 (10 with Kahan's compensation) for AdamW without masters (``train.master_weights = "none"``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from chipset.errors import UsageError
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import MemoryBreakdown, memory_per_stage
from chipset.planner.model import ModelSpec, from_engine_model_config
from chipset.preflight import host_memory_available
from chipset.runtime.optim import make_optimizer
from chipset.runtime.precision import DTYPE_BY_NAME

__all__ = ["from_run_config", "optimizer_bytes", "peak_memory_per_rank", "check_job_memory", "DTYPE_BYTES"]

log = logging.getLogger(__name__)

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPE_BY_NAME.items()}


def optimizer_bytes(train: Any, masters_are_params: bool) -> int:
    """ZeRO's K for the run's optimizer: the state dtype's bytes (``train.optimizer_state_dtype``) per
    declared state tensor, plus 4 for the float32 master unless the parameters are their own masters;
    without masters (``train.master_weights = "none"``) none, and 2 for Kahan's bfloat16 compensation."""
    opt = make_optimizer(train)
    k = opt.state_dtype.itemsize * len(opt.state_names)
    if getattr(train, "master_weights", "float32") == "none":
        return k + (2 if train.bf16_update == "kahan" else 0)
    return k + (0 if masters_are_params else 4)


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
                 schedule=par.schedule, virtual_stages=par.virtual_stages,
                 recompute=tr.recompute, sequence_parallel=par.sequence_parallel,
                 cp_attention=getattr(par, "cp_attention", "allgather"),
                 cp_ulysses=int(getattr(par, "cp_ulysses", 0)),
                 offload_activations=bool(getattr(tr, "offload_activations", False)),
                 loss_chunk=int(getattr(tr, "loss_chunk", 0)))
    train = TrainSpec(global_batch=tr.global_batch, dtype=tr.dtype, fp8=getattr(tr, "fp8", "off"), param_bytes=e, grad_bytes=e,
                      optimizer_bytes=optimizer_bytes(tr, masters_are_params), bucket_mb=par.bucket_mb,
                      fp8_gather_fraction=fp8_gather_fraction(m, cfg))
    return m, lay.check(), train


def fp8_gather_fraction(m: ModelSpec, cfg: Any) -> float:
    """The share of the dense parameters the engine all-gathers in FP8 under ``cfg``
    (``TrainSpec.fp8_gather_fraction``): the attention and MLP projection weights (every block's
    attention, the dense blocks' MLP) over the parameters outside the experts."""
    tr = cfg.train
    if not (cfg.parallel.zero == 3 and tr.fp8 == "tensorwise" and getattr(tr, "fp8_all_gather", True)):
        return 0.0
    h, kv = m.hidden, m.kv_dim
    attention = 2 * h * h + 2 * h * kv
    mlp = (3 if m.mlp == "swiglu" else 2) * h * m.ffn
    return (m.layers * attention + m.dense_layers * mlp) / (m.num_params() - m.expert_params())


def peak_memory_per_rank(cfg: Any, world_size: int | None = None,
                         kernels: str = "reference") -> list[MemoryBreakdown]:
    """Predicted peak device memory of every rank (rank order of ``parallel/dims.py``: pp outermost)."""
    m, lay, train = from_run_config(cfg, world_size, kernels)
    stages = memory_per_stage(m, lay, train, cfg.train.seq_len)
    per_stage = lay.world_size // lay.pp
    middle = "middle" if "middle" in stages else "first"  # the heaviest middle rank bounds the others
    out = []
    for rank in range(lay.world_size):
        idx = rank // per_stage
        if lay.pp > 1 and lay.schedule == "zbv":  # the turning rank bounds the middle ones
            key = "ends" if idx == 0 else "turn"
        else:
            key = "only" if lay.pp == 1 else "first" if idx == 0 else "last" if idx == lay.pp - 1 else middle
        out.append(stages[key])
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


_ADVICE = ("lower model.hidden_size / num_hidden_layers / vocab_size / intermediate_size, train.global_batch "
           "or train.seq_len, or raise parallel.micro_batches, parallel.zero or the tp/pp degrees; for long "
           "sequences parallel.cp, train.offload_activations and train.loss_chunk (docs/long-context.md)")


def check_job_memory(cfg: Any, world_size: int, local_ranks: int, device_memory: int | None,
                     device_is_host: bool, kernels: str = "reference",
                     available: tuple[int, str] | None = None) -> float:
    """Refuse (UsageError) a job whose ranks cannot fit, before any rank allocates a byte.

    Each rank's peak is the planner's estimate (parameters, gradients, optimizer state and the
    activations of the in-flight micro-batches, ``chipset.planner.run.peak_memory_per_rank``)
    plus the rotary tables (``model.max_position_embeddings`` rows, built in float64). It is
    compared with ``device_memory`` (the backend's declared capacity per device, None: unknown)
    and, when the devices are host memory (``device_is_host``), ``local_ranks`` times it with
    the host's available memory. Returns the per-rank estimate in bytes.
    """
    m = cfg.model
    try:
        per_rank = max(b.total for b in peak_memory_per_rank(cfg, world_size, kernels=kernels))
    except Exception as exc:  # a layout the planner cannot model: the run itself is still allowed
        log.info("no memory estimate before launch (%s: %s); the backend's own out-of-memory check applies",
                 type(exc).__name__, exc)
        return 0.0
    head_dim = m.hidden_size // max(1, m.num_attention_heads)
    per_rank += 3 * 8 * m.max_position_embeddings * max(1, head_dim // 2)  # angles, cos, sin (float64)
    log.debug("estimated peak memory per rank: %d bytes", per_rank)
    if device_memory and per_rank > device_memory:
        raise UsageError(
            f"this job needs about {_gib(per_rank)} per rank (planner estimate: parameters, gradients, "
            f"optimizer state, activations of one micro-batch) but each device holds {_gib(device_memory)}; "
            f"{_ADVICE} ('chipset plan' finds a layout that fits)")
    if device_is_host:
        avail = available if available is not None else host_memory_available()
        need = per_rank * local_ranks
        if avail is not None and need > avail[0]:
            raise UsageError(
                f"this job needs about {_gib(need)} of host memory on this node ({local_ranks} rank(s) x "
                f"{_gib(per_rank)}, planner estimate: parameters, gradients, optimizer state, activations of "
                f"one micro-batch) but only {_gib(avail[0])} is available ({avail[1]}); {_ADVICE}, or use "
                "fewer ranks per node")
    return per_rank
