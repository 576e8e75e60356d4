"""Per-step observability: what every rank did in a step, gathered on rank 0.

Each rank measures, per step, its wall time, the seconds it was blocked inside chipset
collectives (``Collective.comm_stats``, counted in the interface's ``_run`` on every
backend), the bytes and calls per collective type, and its current and peak device
memory. One small all-gather per step (not itself counted) brings the numbers to rank 0,
which adds them to the step's ``metrics.jsonl`` record (see docs/observability.md):

- ``compute_s``: wall time outside collectives;
- ``idle_s``: the part of the blocked time explained by waiting for a slower peer,
  ``min(comm_blocked, max_r(compute_s) - compute_s)``;
- ``comm_s``: the rest of the blocked time (moving bytes);
  so ``compute_s + comm_s + idle_s`` is the rank's step time;
- ``slowest_rank``: the rank with the most compute time (the one the others waited for);
- ``data_wait_s``: per rank, the time spent getting its batches (inside ``compute_s``): a
  slow input pipeline shows here (``chipset diagnose``);
- ``cpu_wait_s``: per rank, the time its training thread was ready to run but waited for a host
  CPU (Linux's run-queue delay, :func:`cpu_wait`): other processes competing for the host's cores
  show here, and ``chipset diagnose`` does not call that rank's device slow; absent where the OS
  does not report it;
- ``mfu``: PaLM model FLOPs utilisation, tokens/s x (6N + 12LHQT) / (peak x ranks), with
  the planner's FLOPs count and the device's declared peak for the run dtype (None when
  the backend declares no peak for it); for another model family, samples/s x the family's
  ``flops_per_sample`` / (peak x ranks);
- ``compiles`` (``train.compile``): per rank, the frames torch.compile compiled in the step (a
  first compile or a recompile; chipset.parallel.compile.compiled_frames): after warm-up a
  recompilation storm (``chipset diagnose``);
- ``param_sum`` (every ``train.replica_check_every`` steps) and ``moe`` (MoE models): the
  parameter checksum per rank and the routing load per MoE layer (chipset.train.model_stats).

Optional outputs: the metrics sinks of ``train.metrics_sinks`` on rank 0 (chipset.train.sinks:
TensorBoard event files under ``RUN_DIR/tensorboard`` by default when ``torch.utils.tensorboard``
can be imported; W&B, MLflow or a ``chipset.metrics_sinks`` entry point's), each handed a
step's record once it is complete (after the loop added its evaluation), and with
``train.profile_steps = "a:b"`` a
torch.profiler Chrome trace per rank, ``RUN_DIR/traces/rank<r>.json``, holding chipset's
own ranges (``chipset::step``: the step after its data is fetched, ``chipset::forward``,
``chipset::backward``, ``chipset::optimizer``,
``chipset::stage<N>.forward``/``.backward`` under pipeline parallelism (``.backward_input``/
``.backward_weight`` under the zero-bubble schedule), one
``chipset::<op>`` per collective).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chipset.parallel.compile import compiled_frames
from chipset.train.config import parse_profile_steps
from chipset.train.model_stats import ModelStats
from chipset.train.sinks import SinkSet, open_sinks
from chipset.train.watch import LiveWatch

if TYPE_CHECKING:
    from chipset.loader import Backend

log = logging.getLogger(__name__)

__all__ = ["OPS", "StepMetrics", "parse_profile_steps"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
       "batch_p2p", "barrier", "other")
"""Collective types reported per step; ops of any other name are summed under ``other``."""

# step time, blocked seconds, memory allocated, memory peak, data wait, parameter checksum, compiles, CPU wait
_FIXED = 8

_SCHEDSTAT = "/proc/thread-self/schedstat"


def cpu_wait() -> float:
    """Seconds the calling thread has spent ready to run but waiting for a CPU since it started:
    the second field of Linux's ``/proc/thread-self/schedstat`` (run-queue delay, in ns). NaN where
    the OS does not report it (not Linux, or a kernel without schedstats)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


class StepMetrics:
    """One rank's per-step metrics; call :meth:`begin_step` / :meth:`end_step` on every rank."""

    def __init__(self, cfg, backend: Backend, dims, *, device: torch.device, run_dir: Path | None, rank: int, out,
                 cross=None, model: torch.nn.Module | None = None) -> None:
        self.backend = backend
        self.model_stats = ModelStats(cfg, dims, model)
        self.cross = cross
        """An islands job's link (``totals()``: calls, bytes, seconds between islands), reported apart."""
        self._cross_snap = (0, 0, 0.0)
        self._cross_total = [0, 0, 0.0]
        self.col = backend.collective
        self.world = dims.world_size
        self.rank = rank
        self.device = device
        self.run_dir = run_dir
        self.out = out
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.model_flops_per_token, self.peak_flops = _flops(cfg, backend)
        self._data_wait = 0.0
        self._cpu_wait = math.nan  # cpu_wait() at the step's start
        self._compile = bool(cfg.train.compile)
        self._frames = 0  # compiled_frames() at the step's start (train.compile)
        self._mfu_sum = 0.0
        self._mfu_n = 0
        self._comm_totals: dict[str, list[float]] = {}
        self._snap: dict[str, tuple[int, int, float]] = {}
        self._sinks = open_sinks(cfg, run_dir) if rank == 0 and run_dir is not None else SinkSet([])
        self._pending: dict[str, Any] | None = None  # the last step's record, not yet given to the sinks
        self._profile = parse_profile_steps(cfg.train.profile_steps)
        self._profiler = None
        self._last_step = cfg.train.steps
        self._watch = (LiveWatch([dims.coords(r)["pp"] for r in range(self.world)], profiled=self._profile)
                       if rank == 0 else None)
        if self._profile is not None and self._profile[0] > self._last_step and rank == 0:
            log.warning("no profiler trace: profile_steps %s starts after the run's last step (%d); "
                        "choose steps within 1:%d", cfg.train.profile_steps, self._last_step, self._last_step)

    # --- the step ----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Before step ``step`` (0-based) runs: hand the last step's record to the sinks, start the profiler
        if asked, snapshot counters."""
        self._flush_sinks()
        self.model_stats.begin_step()
        if self._profile is not None and step + 1 == self._profile[0] and self._profiler is None:
            self._profiler = torch.profiler.profile(activities=torch.profiler.supported_activities(),
                                                    record_shapes=False)
            self._profiler.__enter__()
        self._snap = self.col.comm_stats.snapshot()
        self._cpu_wait = cpu_wait()
        if self._compile:
            self._frames = compiled_frames()
        if self.cross is not None:
            self._cross_snap = self.cross.totals()

    def data_wait(self, seconds: float) -> None:
        """This step's time spent getting this rank's batches (part of its compute_s)."""
        self._data_wait += seconds

    def end_step(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Add every rank's numbers to ``rec`` (the step's record, ``step_time_s`` set). Collective."""
        now = self.col.comm_stats.snapshot()
        delta = {op: [0.0, 0.0, 0.0] for op in OPS}
        for op, (calls, nbytes, secs) in now.items():
            c0, b0, s0 = self._snap.get(op, (0, 0, 0.0))
            d = delta[op if op in delta else "other"]
            d[0] += calls - c0
            d[1] += nbytes - b0
            d[2] += secs - s0
        mem = self.backend.memory.stats()
        blocked = sum(d[2] for d in delta.values())
        local = [rec["step_time_s"], blocked, float(mem.allocated), float(mem.peak_allocated), self._data_wait,
                 self.model_stats.param_sum(int(rec["step"])),
                 float(compiled_frames() - self._frames) if self._compile else 0.0,
                 cpu_wait() - self._cpu_wait]
        self._data_wait = 0.0
        for op in OPS:
            local += delta[op]
        if self.cross is not None:  # bytes that left the island: counted apart from its own collectives
            local += [a - b for a, b in zip(self.cross.totals(), self._cross_snap, strict=True)]
        self._finish_profile_step(int(rec["step"]))  # before the gather below, which is not the step's
        vec = torch.tensor(local, dtype=torch.float64, device=self.device)
        if self.world > 1:
            allv = torch.empty(self.world * vec.numel(), dtype=torch.float64, device=self.device)
            self.col.all_gather(allv, vec)
            rows = allv.view(self.world, -1).tolist()
        else:
            rows = [vec.tolist()]
        moe = self.model_stats.moe_load(self.col, self.device, self.world)  # after the snapshot: not counted
        if moe:
            rec["moe"] = moe
        if not math.isnan(rows[0][5]):
            rec["param_sum"] = [r[5] for r in rows]
        if self._compile:
            rec["compiles"] = [int(r[6]) for r in rows]
        if all(math.isfinite(r[7]) for r in rows):
            rec["cpu_wait_s"] = [r[7] for r in rows]
        step_t = [r[0] for r in rows]
        blocked_t = [min(r[1], r[0]) for r in rows]
        compute = [s - b for s, b in zip(step_t, blocked_t, strict=True)]
        slowest = max(range(self.world), key=lambda i: compute[i])
        idle = [min(b, compute[slowest] - c) for b, c in zip(blocked_t, compute, strict=True)]
        comm = {}
        for i, op in enumerate(OPS):
            j = _FIXED + 3 * i
            calls = [int(r[j]) for r in rows]
            if any(calls):
                comm[op] = {"calls": calls, "bytes": [int(r[j + 1]) for r in rows],
                            "seconds": [r[j + 2] for r in rows]}
                tot = self._comm_totals.setdefault(op, [0.0, 0.0, 0.0])
                tot[0] += sum(calls)
                tot[1] += sum(comm[op]["bytes"])
                tot[2] += sum(comm[op]["seconds"])
        if self.cross is not None:
            j = _FIXED + 3 * len(OPS)
            cross = {"calls": [int(r[j]) for r in rows], "bytes": [int(r[j + 1]) for r in rows],
                     "seconds": [r[j + 2] for r in rows]}
            rec["cross_island"] = cross
            for i, key in enumerate(("calls", "bytes", "seconds")):
                self._cross_total[i] += sum(cross[key])
        mfu = None
        if self.peak_flops > 0 and rec["step_time_s"] > 0:
            mfu = rec["tokens_per_s"] * self.model_flops_per_token / (self.peak_flops * self.world)
            self._mfu_sum += mfu
            self._mfu_n += 1
        rec.update({
            "mfu": mfu,
            "memory_bytes": [int(r[2]) for r in rows],
            "peak_memory_bytes_per_rank": [int(r[3]) for r in rows],
            "step_time_s_per_rank": step_t,
            "data_wait_s": [r[4] for r in rows],
            "compute_s": compute,
            "comm_s": [b - i for b, i in zip(blocked_t, idle, strict=True)],
            "idle_s": idle,
            "slowest_rank": slowest,
            "comm": comm,
        })
        if self._watch is not None:
            for line in self._watch.step(rec):
                print(line, file=self.out, flush=True)
        # The sinks get ``rec`` at the next begin_step or close(): the loop adds the step's evaluation
        # (eval_loss, ...) to this same dict after end_step returns it.
        self._pending = rec if self._sinks else None
        return rec

    # --- outputs -------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Run-level fields for summary.json: devices, peak FLOP/s, mean MFU, communication totals."""
        props = self.backend.device.properties()
        return {
            "devices": {"name": props.name, "count_per_node": self.backend.device.device_count(),
                        "total_memory_bytes": int(props.total_memory),
                        "peak_flops": dict(props.peak_flops), "estimated": bool(props.estimated)},
            "model_flops_per_token": self.model_flops_per_token,
            "mfu": self._mfu_sum / self._mfu_n if self._mfu_n else None,
            "comm_totals": {op: {"calls": int(t[0]), "bytes": int(t[1]), "seconds": t[2]}
                            for op, t in self._comm_totals.items()},
            **({"cross_island_totals": {"calls": int(self._cross_total[0]), "bytes": int(self._cross_total[1]),
                                        "seconds": self._cross_total[2]}} if self.cross is not None else {}),
        }

    def close(self) -> None:
        """Stop a profiler that is still running (the run ended before its last step); give the last
        record to the sinks and close them."""
        self._finish_profile_step(None)
        self._flush_sinks()
        self._sinks.close()

    def _flush_sinks(self) -> None:
        rec, self._pending = self._pending, None
        if rec is not None:
            self._sinks.log(int(rec["step"]), rec)

    def _finish_profile_step(self, step: int | None) -> None:
        if self._profiler is None:
            return
        if step is not None and step < min(self._profile[1], self._last_step):
            return
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        if self.run_dir is not None:
            path = self.run_dir / "traces" / f"rank{self.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            if self.rank == 0:
                log.info("profiler trace of steps %d:%s per rank in %s (open in https://ui.perfetto.dev "
                         "or chrome://tracing)", self._profile[0], step or "?", path.parent)


def _flops(cfg, backend: Backend) -> tuple[int, float]:
    """PaLM model FLOPs per token (the planner's count) and the total peak FLOP/s of one device."""
    from chipset.models.registry import resolve_family
    from chipset.planner.flops import model_flops_per_token
    from chipset.planner.model import from_engine_model_config

    try:
        family = resolve_family(cfg.model.family)
        if getattr(family, "described_by_planner", False):
            spec = from_engine_model_config(cfg.model, seq_len=cfg.train.seq_len)
            per_token = model_flops_per_token(spec)
        else:  # the family counts its own FLOPs; "tokens" per step are global_batch x seq_len
            per_token = family.flops_per_sample(cfg) / cfg.train.seq_len
    except Exception:  # a model the planner cannot describe yet: no MFU rather than no run
        per_token = 0
    peak = backend.device.properties().peak_flops_for(cfg.train.dtype)
    return per_token, (peak if per_token else 0.0)
