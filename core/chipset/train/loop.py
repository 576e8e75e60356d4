"""The training loop one rank runs: build, train, log, summarise.

Reaches hardware only through the backend's interfaces. Rank 0 prints progress and
writes ``metrics.jsonl`` and ``summary.json`` into the run directory.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chipset.data.datasets import SyntheticTokens, TextBytes
from chipset.errors import ChipsetError, ConfigError
from chipset.models.family import (
    BoundModel,
    bind,
    build_for_run,
    family_data,
    layout_problems,
    meta_model,
)
from chipset.models.registry import resolve_family
from chipset.parallel.compile import apply_compile, check_compile, compile_backend_of
from chipset.parallel.context import ContextParallel, apply_cp
from chipset.parallel.dims import ParallelDims
from chipset.parallel.experts import apply_ep
from chipset.parallel.fp8 import apply_fp8, check_fp8, fp8_targets
from chipset.parallel.hybrid import hybrid_groups
from chipset.parallel.linear import apply_linear
from chipset.parallel.lora import apply_lora, lora_of
from chipset.parallel.moe import apply_cp_moe
from chipset.parallel.offload import apply_offload
from chipset.parallel.recompute import apply_recompute
from chipset.parallel.tensor import TPContext, apply_plan
from chipset.runtime.bf16_update import Bf16Update
from chipset.runtime.data_parallel import DataParallel
from chipset.runtime.digest import params_digest
from chipset.runtime.optim import make_optimizer
from chipset.runtime.pipeline import build_pipeline
from chipset.runtime.precision import DTYPE_BY_NAME, LossScaler
from chipset.runtime.trace import trace_range
from chipset.train import lr as lr_schedule
from chipset.train.config import RunConfig, parse_profile_steps
from chipset.train.evaluate import Evaluator, family_unit
from chipset.train.metrics import StepMetrics
from chipset.train.progress import Progress, fmt_bytes
from chipset.train.rundir import (
    atomic_write_text,
    finished_message,
    finite_json,
    read_run_id,
    strict_dumps,
)
from chipset.train.signals import stop_point

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["TrainResult", "build", "build_model", "make_dims", "params_digest", "rank_batches", "train",
           "train_step", "wrap"]


@dataclass
class TrainResult:
    """What one rank saw: per-step losses and stats, and the final unsharded parameters."""

    losses: list[float] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    launch_log: list[tuple[int, int]] = field(default_factory=list)
    """Last step's gradient launches: (bucket, buckets still computing gradients at launch)."""


def make_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The layout of ``cfg.parallel`` on ``world_size`` ranks (``parallel.dp = 0``: what is left)."""
    par = cfg.parallel
    dp = par.dp or world_size // max(1, par.tp * par.pp * par.cp)
    return ParallelDims(dp=dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, zero=par.zero, world_size=world_size)


def param_line(cfg: RunConfig, engine, dims: ParallelDims) -> str:
    """``"N params (M on rank 0)"`` for the start banner: N the whole model's parameter count
    (its shapes on the meta device, nothing allocated), M what rank 0 holds: its tp/pp/ep share,
    divided over dp under ZeRO-3. One number alone misled: per rank under tp/pp, the whole model
    under ZeRO-3."""
    local = sum(p.numel() for p in engine.model.parameters())  # this rank's tp/pp/ep share, dp-replicated
    held = -(-local // dims.dp) if dims.zero == 3 else local
    try:
        total = sum(p.numel() for p in meta_model(resolve_family(cfg.model.family), cfg).parameters())
    except Exception:  # noqa: BLE001 - a family that cannot build on the meta device: the banner says less
        return f"{held:,} params on rank 0"
    return f"{total:,} params" + ("" if held == total else f" ({held:,} on rank 0)")


def build(cfg: RunConfig, backend: Backend) -> tuple[DataParallel, SyntheticTokens | TextBytes, ParallelDims]:
    """Model, engine and data for this rank (process group must be initialised)."""
    dims = make_dims(cfg, backend.collective.world_size())
    family = resolve_family(cfg.model.family)
    engine = wrap(build_model(cfg, backend, dims, family), cfg, backend, dims)
    data = family_data(family, cfg)
    return engine, data, dims


def build_model(cfg: RunConfig, backend: Backend, dims: ParallelDims, family) -> BoundModel:
    """``family``'s model for ``cfg``, split for ``dims`` (tp, cp, ep), with recompute and compile
    applied, bound to the family (a :class:`chipset.models.family.BoundModel`: the module as
    ``.module``, and the family's units, loss and pipeline chain): this rank's share, not yet
    wrapped. Refuses a layout the family does not support."""
    col = backend.collective
    par, tr = cfg.parallel, cfg.train
    problems = layout_problems(family, cfg)
    if problems:  # the launcher refused these already; a worker started by hand refuses too
        raise ConfigError("; ".join(problems))
    # With init_from the weights come from the file into the shards this rank holds (wrap).
    model = build_for_run(family, cfg, backend.kernels)
    if dims.tp_enabled:  # the family's plan; the engine names no module (models/family.py)
        tp = TPContext(col, dims.group("tp", col), sequence_parallel=par.sequence_parallel)
        apply_plan(model, family.plan(cfg), tp=tp)
    # After the plan: every linear layer (the split ones too) on the backend's GEMM, plain nn.Linear
    # layers swapped for routed ones, which LoRA and FP8 then act on (parallel/linear.py)
    model = apply_linear(model, backend.kernels)
    lora = lora_of(cfg, family)
    if lora is not None:  # after the plan: the adapters follow its split (parallel/lora.py)
        apply_lora(model, lora, seed=cfg.train.seed, linear=backend.kernels.resolve("linear"))
    if tr.fp8 != "off":  # after the plan and LoRA: the split projections, the adapters stay in train.dtype
        check_fp8(tr.fp8, backend)
        apply_fp8(model, fp8_targets(model, family, cfg), backend.kernels, tr.fp8)
    if dims.cp_enabled:
        group = dims.group("cp", col)
        subgroups = None
        if par.cp_attention == "hybrid":  # after the cp groups: every rank creates groups in one order
            subgroups = hybrid_groups(col, dims.group_ranks("cp"), par.cp_ulysses)
        cp = ContextParallel(col, group, backend.kernels, attention=par.cp_attention, subgroups=subgroups)
        apply_cp(model, family.attention(model), cp=cp)
        apply_cp_moe(model, cp=cp)
    if dims.ep_enabled:
        apply_ep(model, dims=dims, collective=col)
    compile_backend = check_compile(tr.compile, backend.name, backend.record.descriptor)
    if compile_backend is not None:  # per block, before the engine wraps the model (parallel/compile.py)
        apply_compile(family.blocks(model), compile_backend)
    # After compile: a recomputed block checkpoints its compiled forward, from eager code.
    apply_recompute(model, mode=tr.recompute, family=family)
    if tr.offload_activations:  # outside recompute: a recomputed block saves only its inputs
        side = backend.device if backend.capabilities.streams else None  # copies overlap compute there
        apply_offload(family.blocks(model), backend.memory, side)
    if cfg.data.document_mask:
        model.document_eos = document_eos(cfg)
    if tr.loss_chunk:
        model.loss_chunk = tr.loss_chunk
    return bind(family, model, cfg)


def document_eos(cfg: RunConfig) -> int:
    """The id that ends a document for ``data.document_mask``: ``data.eos_id``, else the one the
    tokens folder records; ConfigError when neither names one."""
    da = cfg.data
    if da.eos_id >= 0:
        return da.eos_id
    from chipset.data.store import open_tokens

    eos = open_tokens(da.path).meta.get("eos_id") if da.source == "tokens" and not da.blend else None
    if eos is None or eos < 0:
        raise ConfigError(f"data.document_mask needs the end-of-document id: data.path = {da.path!r} records "
                          "none; set data.eos_id")
    return int(eos)


def wrap(bound: BoundModel, cfg: RunConfig, backend: Backend, dims: ParallelDims):
    """The engine that trains ``bound`` (from :func:`build_model`) under ``dims``: gradient
    reduction, ZeRO sharding, the optimizer ``train.optimizer`` names (runtime/optim.py), loss
    scaling, and the pipeline schedule when pp > 1."""
    par, tr = cfg.parallel, cfg.train
    dtype = DTYPE_BY_NAME[tr.dtype]
    backend.device.check_dtype(dtype)
    if tr.dtype == "float16":
        scaler = LossScaler(
            scale=tr.loss_scale or tr.initial_loss_scale, dynamic=tr.loss_scale == 0,
            window=tr.loss_scale_window, hysteresis=tr.hysteresis, min_scale=tr.min_loss_scale,
        )
    else:
        scaler = LossScaler(scale=1.0, dynamic=False)
    # pp > 1: this rank's stages, with DataParallel over dp inside (runtime/pipeline/).
    make = partial(build_pipeline, par) if dims.pp_enabled else DataParallel
    engine = make(
        bound, backend, dims, dtype=dtype, bucket_mb=par.bucket_mb, micro_batches=par.micro_batches,
        grad_clip=tr.grad_clip, optimizer=make_optimizer(tr),
        scaler=scaler, offload_optimizer=par.offload_optimizer, weights_to_load=bool(cfg.model.init_from),
        **_bf16_update(tr),
        fp8_all_gather=tr.fp8_all_gather,
    )
    if cfg.model.init_from:  # Hugging Face weights into the shards this rank holds (models/hf/weights.py)
        from chipset.train.hf_weights import load_into_engine

        load_into_engine(engine, cfg.model.init_from, cfg.model.architecture)
    return engine


def _bf16_update(tr) -> dict:
    """The engine's ``bf16_update`` for ``train.master_weights = "none"`` (runtime/bf16_update.py), else nothing."""
    if tr.master_weights == "float32":
        return {}
    if tr.dtype != "bfloat16":  # train.dtype = "auto" became another dtype on this backend
        raise ConfigError(f"train.master_weights = 'none' needs bfloat16 parameters; train.dtype is {tr.dtype!r} on "
                          "this backend (auto picks its default): set train.dtype = 'bfloat16' or train.master_weights = 'float32'")
    return {"bf16_update": Bf16Update(tr.bf16_update, seed=tr.seed)}


def rank_batches(data, step: int, engine, micro_batches: int,
                 replica: tuple[int, int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of ``step`` from ``data`` (an object with ``batch(step, dp_rank,
    dp, micro, micro_batches, device=)``). Data is split over dp only: the tp, cp and pp ranks of
    one dp index read the same samples. ``replica``: (index, count) of this rank's share when
    the batch is split wider than the engine's dp (islands: ``Islands.replica``)."""
    dims = engine.dims
    dp_rank, dp = replica or (dims.coords(engine.collective.rank())["dp"], dims.dp)
    return [data.batch(step, dp_rank, dp, m, micro_batches, device=engine.device)
            for m in range(micro_batches)]


def train_step(engine, batches, lr: float, loss_factor: float = 1.0) -> tuple[float, dict]:
    """One optimizer step over ``batches`` (this rank's micro-batches, one ``(inputs, targets)``
    each): forward and backward of every micro-batch (gradients reduced over dp, ZeRO-sharded, as
    the engine's layout says), then the update at ``lr``. Returns the loss of the global batch (the
    mean over micro-batches and dp ranks, the same on every rank) and the step's stats
    (``grad_norm``, ``skipped``, ``loss_scale``). ``loss_factor`` multiplies the loss before backward
    (``Collective.loss_factor``: 1.0 but for an injected loss spike)."""
    batches = list(batches)
    if len(batches) != engine.micro_batches:
        raise ConfigError(f"train_step got {len(batches)} micro-batch(es), the engine was built for "
                          f"{engine.micro_batches} (parallel.micro_batches); pass exactly that many (inputs, targets)")
    losses = engine.forward_backward_step(batches, loss_factor=loss_factor)
    with trace_range("chipset::optimizer"):
        stats = engine.step(lr)
    loss_t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float32, device=engine.device)
    if engine.dp > 1:
        engine.collective.all_reduce(loss_t, "sum", group=engine.group)
        loss_t /= engine.dp
    return float(loss_t), stats


def lr_at(cfg: RunConfig, step: int) -> float:
    """The learning rate of 0-based ``step`` (chipset.train.lr)."""
    return lr_schedule.lr_at(cfg.train, step)


_fmt_bytes = fmt_bytes


def train(cfg: RunConfig, backend: Backend, run_dir: str | Path | None = None, *, out=None, keep_params: bool = False,
          resume: str = "none", elastic=None) -> TrainResult:
    """Run ``cfg`` on this rank. The process group must be initialised and the device set.

    ``resume``: ``auto`` (newest complete checkpoint of ``run_dir``), ``none`` or a checkpoint
    path (docs/fault-tolerance.md); checkpoints are written every ``train.checkpoint_every`` steps.
    ``elastic``: the :class:`chipset.train.elastic.WorldChange` already applied to ``cfg``
    when the job runs on fewer nodes than planned (logged and kept in the summary).
    """
    out = out or sys.stdout
    col = backend.collective
    rank = col.rank()
    if elastic is not None and rank == 0:
        print(elastic.line(), file=out, flush=True)
    began = time.perf_counter()
    engine, data, dims = build(cfg, backend)
    from chipset.train.islands.outer import islands_for_run

    islands = islands_for_run(cfg, backend, engine, run_dir)  # None outside an islands job (docs/islands.md)
    if islands is not None:
        data = islands.watch(data)  # islands.client_data: the island's summary records what it read
    tr, par = cfg.train, cfg.parallel
    device = engine.device
    run_dir = Path(run_dir) if run_dir is not None else None
    metrics_file = None
    ckpt = None
    if run_dir is not None and (tr.checkpoint_every or resume != "none"
                                or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")):
        from chipset.train.checkpoint import Checkpointer

        ckpt = Checkpointer(cfg, backend, engine, run_dir, out=out)
        ckpt.islands = islands
    start = ckpt.resume(resume) if ckpt is not None else 0
    if islands is not None:  # an island the launcher restarted fetches the global state first
        start = islands.start(start)
    # Run-directory safety (docs/fault-tolerance.md, "Run directories"): a finished run is not redone.
    finished = start > 0 and start >= tr.steps
    if finished and rank == 0:
        print(finished_message(run_dir, start), file=out, flush=True)
    nonfinite = _NonFinite(tr.max_nonfinite_steps)
    if run_dir is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(run_dir / "metrics.jsonl", "a" if start else "w")
    tokens_per_step = tr.global_batch * tr.seq_len  # metrics' tokens_per_s: samples x seq_len for every family
    res = TrainResult()
    # In an islands job only island 0 prints progress; every island writes its own metrics and summary.
    speaks = rank == 0 and (islands is None or islands.island == 0)
    if speaks:
        print(f"chipset train: backend {backend.name}, world {dims.world_size}, layout "
              + " ".join(f"{k}={v}" for k, v in dims.layout().items())
              + f", {param_line(cfg, engine, dims)}, dtype {tr.dtype}, "
              f"recompute {tr.recompute}", file=out, flush=True)
    overall_peak = 0
    times = []
    obs = StepMetrics(cfg, backend, dims, device=device, run_dir=run_dir, rank=rank, out=out,
                      cross=islands.link if islands is not None else None, model=engine.model)
    progress = Progress(cfg, out, start_step=start, enabled=speaks)
    family = resolve_family(cfg.model.family)
    evaluator = Evaluator(cfg, engine, dims, col, rank, family) if tr.eval_every else None
    last_eval = None
    try:
        for step in range(start, tr.steps):
            col.notify_step(step)
            backend.memory.reset_peak_stats()
            obs.begin_step(step)
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            replica = islands.replica() if islands is not None else None
            col.notify_batch(step)  # inside the wait for data: a backend's injected slow loader lands there
            batches = rank_batches(data, step, engine, par.micro_batches, replica)
            obs.data_wait(time.perf_counter() - t0)  # this rank's wait for its batches (diagnose: slow loader)
            with trace_range("chipset::step"):  # the step after its data, in a profiler trace (diagnose: host overhead)
                col.notify_compute(step)  # on the host before the forward: a backend's injected host delay lands there
                loss, stats = train_step(engine, batches, lr, col.loss_factor(step))
                if islands is not None and islands.due(step + 1):
                    islands.sync(step + 1)  # the outer step: pseudo-gradients averaged between islands
                backend.device.synchronize()
            dt = time.perf_counter() - t0
            times.append(dt)
            peak = backend.memory.stats().peak_allocated
            overall_peak = max(overall_peak, peak)
            rec = {"step": step + 1, "loss": loss, "grad_norm": stats["grad_norm"], "lr": lr,
                   "loss_scale": stats["loss_scale"], "skipped": stats["skipped"],
                   "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "peak_memory_bytes": peak}
            rec = obs.end_step(rec)  # every rank's time, memory and communication, gathered
            if evaluator is not None and evaluator.due(step + 1):
                evaluated = evaluator.run()
                rec.update(evaluated)
                progress.eval(step + 1, evaluated)
                last_eval = {**evaluated, "eval_step": step + 1}
            res.losses.append(loss)
            res.metrics.append(rec)
            if metrics_file is not None:
                metrics_file.write(strict_dumps(rec) + "\n")  # NaN/inf as null: every JSON parser reads it
                metrics_file.flush()
            nonfinite.check(step + 1, loss, stats["skipped"])  # same loss and skip on every rank
            if ckpt is not None and ckpt.due(step + 1):
                ckpt.save(step + 1)
            progress.step(rec, stats["skipped"])
            stop_point(col, device, step + 1, ckpt)  # SIGINT/SIGTERM: every rank stops here (train/signals.py)
        if ckpt is not None:
            ckpt.finish()  # an asynchronous save completes (or raises) before the summary
    finally:
        progress.close()
        obs.close()
        if islands is not None:
            islands.close()
        if metrics_file is not None:
            metrics_file.close()

    res.launch_log = list(engine.launch_log)
    # Hashed shard by shard (one bucket unsharded at a time): never the whole model on a rank.
    digest = engine.params_digest()
    peaks = torch.zeros(dims.world_size, dtype=torch.float64, device=device)
    peaks[rank] = overall_peak
    if dims.world_size > 1:
        col.all_reduce(peaks, "sum")
    steady = times[1:] or times
    summary = {
        "final_loss": res.losses[-1] if res.losses else _last_logged_loss(run_dir),
        "steps": tr.steps,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady) if steady else 0.0,
        "samples_per_s": tr.global_batch * len(steady) / sum(steady) if steady else 0.0,
        "throughput_unit": family_unit(family, cfg),
        "world_size": dims.world_size,
        "layout": dims.layout(),
        # what the pipeline bubble's theory needs (chipset diagnose: pipeline_bubble)
        "pipeline": {"schedule": par.schedule, "micro_batches": par.micro_batches,
                     "virtual_stages": par.virtual_stages},
        # the steps train.profile_steps profiled (chipset diagnose: the profiler's own buffers
        # grow the host memory from the first, which the leak check must not read as a leak)
        "profiled_steps": list(parse_profile_steps(tr.profile_steps) or ()),
        "dtype": tr.dtype,
        "recompute": tr.recompute,
        "compile": compile_backend_of(backend.record.descriptor) if tr.compile else None,
        "backend": backend.name,
        "peak_memory_bytes": [int(x) for x in peaks.tolist()],
        "skipped_steps": engine.scaler.skipped_steps,
        "loss_scale": engine.scaler.state_dict(),
        "params_digest": digest,
        "wall_time_s": round(time.perf_counter() - began, 3),  # build, steps, evaluation and checkpoints
        **obs.summary(),
        **(last_eval or {}),
        **(ckpt.summary() if ckpt is not None else {}),
        **({"elastic": elastic.to_dict()} if elastic is not None else {}),
        **({"islands": islands.summary()} if islands is not None else {}),
        **({"run_id": read_run_id(run_dir)} if run_dir is not None and rank == 0 else {}),  # finished_step
    }
    res.summary = summary
    if keep_params:  # the caller asked for the whole model on every rank (tests, small models)
        res.params = engine.full_parameters()
    if rank == 0:
        if run_dir is not None and finished and _readable_summary(run_dir / "summary.json"):
            res.summary = json.loads((run_dir / "summary.json").read_text())  # the run's own, kept
        else:
            if run_dir is not None:
                _write_summary(run_dir / "summary.json", summary)
            if speaks:
                _print_table(summary, res, out)
    return res


class NonFiniteLossError(ChipsetError):
    """The loss stayed NaN/inf (or every update overflowed) for ``train.max_nonfinite_steps`` steps."""


class _NonFinite:
    """Counts consecutive steps whose loss is NaN/inf or whose update was skipped (overflow)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.run = 0
        self.first = 0

    def check(self, step: int, loss: float, skipped: bool) -> None:
        if math.isfinite(loss) and not skipped:
            self.run = 0
            return
        self.run += 1
        self.first = self.first if self.run > 1 else step
        if self.limit and self.run >= self.limit:
            raise NonFiniteLossError(
                f"the loss was NaN/inf or the update overflowed for {self.run} consecutive steps "
                f"(steps {self.first}-{step}, last loss {loss}); the run diverged, so it stops here "
                f"(train.max_nonfinite_steps = {self.limit}). Lower train.lr, add train.warmup_steps or "
                "train.grad_clip, or use float32/bfloat16; resume from an earlier checkpoint with --resume PATH")


def _last_logged_loss(run_dir: Path | None) -> float | None:
    """The last loss in metrics.jsonl (a resumed run that had no step left to do)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if run_dir is not None else []
        return json.loads(lines[-1]).get("loss") if lines else None
    except (OSError, ValueError, AttributeError):
        return None


def _readable_summary(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return False


def _write_summary(path: Path, summary: dict) -> None:
    """Atomically and as strict JSON; NaN/inf values become null and are named in ``nonfinite_values``."""
    bad: list[str] = []
    clean = finite_json(summary, bad=bad)
    if bad:
        clean["nonfinite_values"] = bad
    atomic_write_text(path, json.dumps(clean, indent=2, allow_nan=False) + "\n")


def _fmt_seconds(s: float) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def _print_table(summary: dict, res: TrainResult, out) -> None:
    def fmt(x) -> str:
        return f"{x:.4f}" if isinstance(x, (int, float)) else "-"

    first = res.losses[0] if res.losses else None
    rows = [
        ("steps", str(summary["steps"])),
        ("loss (first -> final)", f"{fmt(first)} -> {fmt(summary['final_loss'])}"),
        (f"{summary['throughput_unit']}/s (steady)",
         f"{summary['tokens_per_s' if summary['throughput_unit'] == 'tokens' else 'samples_per_s']:.0f}"),
        ("world size", str(summary["world_size"])),
        ("layout", " ".join(f"{k}={v}" for k, v in summary["layout"].items())),
        ("dtype / recompute", f"{summary['dtype']} / {summary['recompute']}"),
        ("peak memory per rank", ", ".join(_fmt_bytes(x) for x in summary["peak_memory_bytes"])),
        *([(f"eval loss (step {summary['eval_step']})", fmt(summary["eval_loss"]))] if "eval_loss" in summary else []),
        *([("eval accuracy", f"{100 * summary['eval_accuracy']:.1f}%")] if "eval_accuracy" in summary else []),
        ("skipped steps", str(summary["skipped_steps"])),
        ("total time", _fmt_seconds(summary["wall_time_s"])),
        ("params digest", summary["params_digest"][:16] + "..."),
    ]
    w = max(len(k) for k, _ in rows)
    print("-" * (w + 40), file=out)
    for k, v in rows:
        print(f"{k:<{w}}  {v}", file=out)
    print("-" * (w + 40), file=out, flush=True)
