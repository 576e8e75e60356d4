"""Pipeline parallelism with schedules as data (docs/engine.md, "Pipeline parallel").

* :mod:`.schedules` — GPipe, 1F1B, interleaved 1F1B, zero bubble (ZB-H1) as per-rank
  instruction lists.
* :mod:`.split_backward` — a backward in two halves (input gradient now, weight gradients
  later) for the zero-bubble schedule.
* :mod:`.check` — a simulator proving a schedule deadlock-free with matching transfers,
  before anything runs; also its timeline and bubble.
* :mod:`.split` — the rules of a split: ``parallel.pipeline_split`` read, a chain balanced.
* :mod:`.units` — a family's chain of pipeline units cut into stages (balanced by parameters
  or explicit), a rank's stages as one module under single-process names.
* :mod:`.runtime` — :class:`PipelineEngine` executes a schedule with batched p2p, data
  parallelism (ZeRO 0-3) over each stage's parameters; with context parallelism each cp
  rank pipelines its share of every sequence, with sequence parallelism each tp rank sends
  only its slice of the hidden states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chipset.errors import ConfigError
from chipset.parallel.split import parse_split
from chipset.parallel.stages import UnitSpec, UnitStageModel, split_units
from chipset.runtime.pipeline.check import ScheduleError, SimResult, check_schedule, render
from chipset.runtime.pipeline.engine import PipelineEngine
from chipset.runtime.pipeline.schedules import (
    SCHEDULES,
    Instruction,
    Op,
    PipelineSchedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zbv,
    zero_bubble,
)

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = [
    "SCHEDULES",
    "Instruction",
    "Op",
    "PipelineEngine",
    "PipelineSchedule",
    "ScheduleError",
    "SimResult",
    "UnitSpec",
    "UnitStageModel",
    "build_pipeline",
    "check_schedule",
    "describe_pipeline",
    "render",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "parse_split",
    "pipeline_problems",
    "schedule_for",
    "zero_bubble",
    "zbv",
    "split_units",
]


def schedule_for(par) -> PipelineSchedule:
    """The checked schedule a :class:`chipset.train.config.ParallelConfig` asks for (ScheduleError if broken)."""
    sched = make_schedule(par.schedule, par.pp, par.micro_batches, par.virtual_stages)
    check_schedule(sched)
    return sched


def pipeline_problems(cfg, units: int | None = None) -> list[str]:
    """The schedule's problems for a pp > 1 run, as messages (called by config validation).

    ``units``: how many pipeline units the model has, when the family knows it before any model
    exists (the schedule is not built when pp*virtual_stages exceeds it: the family refuses
    that itself). How a family's chain of units splits is the family's rule
    (``ModelFamily.config_problems``, :func:`chipset.parallel.stages.chain_problems`)."""
    par = cfg.parallel
    parts = par.pp * max(par.virtual_stages, 1)
    fits = units is None or parts <= units
    problems = []
    if par.schedule not in SCHEDULES:
        problems.append(f"parallel.schedule = {par.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    elif par.virtual_stages < 1:
        problems.append(f"parallel.virtual_stages = {par.virtual_stages!r}: expected a positive number of chunks")
    elif par.schedule == "interleaved_1f1b" and par.virtual_stages < 2:
        problems.append(
            f"parallel.schedule = 'interleaved_1f1b' needs parallel.virtual_stages >= 2 (found {par.virtual_stages}); "
            "set parallel.virtual_stages=2 or choose schedule 1f1b"
        )
    elif par.micro_batches > 0 and fits:
        try:
            schedule_for(par)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def build_pipeline(par, bound, backend: Backend, dims, **dp_kwargs) -> PipelineEngine:
    """This rank's :class:`PipelineEngine` for ``bound`` (a model bound to its family,
    :class:`chipset.models.family.BoundModel`) under ``par``."""
    sched = schedule_for(par)
    specs = split_units(bound, par.pp * par.virtual_stages, par.pipeline_split)
    return PipelineEngine(bound, backend, dims, sched, specs, **dp_kwargs)


def describe_pipeline(cfg, bound) -> str:
    """What ``chipset train --print-schedule`` prints: the split, then the checked schedule.

    ``bound``: the run's model bound to its family, built on the meta device (shapes only: no
    memory, no initialisation cost; ``chipset.models.family.meta_model``)."""
    par = cfg.parallel
    sched = schedule_for(par)
    specs = split_units(bound, par.pp * par.virtual_stages, par.pipeline_split)
    units = bound.pipeline_units()
    how = "explicit: " + par.pipeline_split if par.pipeline_split else "balanced by parameter count"
    lines = [f"pipeline split ({how}):"]
    for spec in specs:
        n = sum(p.numel() for m in units[spec.first:spec.last] for p in m.parameters())
        rank, chunk = sched.locate(spec.virtual_stage)
        chunk_txt = f", chunk {chunk}" if sched.virtual_stages > 1 else ""
        lines.append(f"  virtual stage {spec.virtual_stage} (rank {rank}{chunk_txt}): {spec.describe()}  [{n} params]")
    return "\n".join(lines) + "\n\n" + render(sched)
