"""The planned-step check: the measured step against the planner's prediction of the same step, term by term.

The prediction is ``summary.json``'s ``projection`` (``chipset train --project PROFILE``) or, without one,
the same projection computed here (:func:`chipset.planner.projection.project`) from the run's
``config.toml``, its last step's collective counts and the device profile ``summary.json`` names.

Terms (seconds per step, mean over the steady steps):

- ``compute``: measured, the smallest ``compute_s - data_wait_s`` over the ranks (the work every rank
  does; a slower rank's extra shows as its peers' ``idle``); predicted, compute + optimizer + host.
- one term per process group, named by the parallel dimensions that issue the collective type
  (``dp``, ``tp``, ``ep``, ``cp``, ``pp``; ``dp+tp`` when both issue it and the record cannot tell
  them apart): measured, the exposed communication (``comm_s``) of the rank with the most, split
  over the types in proportion to that rank's seconds in each (``comm.<op>.seconds``); predicted,
  the type's exposed seconds (``projection.comm_ops``). ``pp`` includes the predicted bubble: a stage
  waiting for its neighbour blocks in the same point-to-point ops.
- ``idle`` (waiting for a slower peer) and ``data`` (waiting for batches): predicted 0.

Clocks: on a device whose properties are labelled estimates (``summary.json``'s
``devices.estimated``: a simulator computes on the host, not on the device it simulates) or
measured on another device than the projection's profile, absolute times do not compare. There the
prediction is scaled by ``k = measured compute / predicted compute`` (ratio mode: the prediction
on the run's own compute clock) and compute cannot be the term at fault; on the profiled device
itself (``devices.estimated`` false, the same name) ``k = 1`` (absolute mode) and compute is a term
like the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chipset.diagnose.rules import steady
from chipset.errors import ChipsetError

SLOWER = 4.0
"""A step is far slower than planned when it takes at least this factor of the (scaled) prediction.
The planner is a model, not a measurement, and in ratio mode the links are the host's too: a clean 2-rank cpu_sim run measures 2-2.5x its compute-scaled plan (gloo
on loopback moves a tiny gradient slower than the simulated link scaled by the host's compute clock),
4.3x in a step under the profiler. 4x leaves that out and keeps a slow link or rank, at 10x and more."""
SHARE = 0.5
"""... in at least this share of the steady steps."""


def _projection(run_dir: Path, recs: list[dict[str, Any]], summary: dict[str, Any]) -> tuple[dict | None, str | None]:
    """(projection, why there is none)."""
    proj = summary.get("projection")
    if isinstance(proj, dict) and isinstance(proj.get("comm_ops"), dict) and proj.get("step_time_s"):
        return proj, None
    config = run_dir / "config.toml"
    profile = (summary.get("devices") or {}).get("name")
    world = summary.get("world_size")
    comm = next((r["comm"] for r in reversed(recs) if isinstance(r.get("comm"), dict)), None)
    if not config.is_file() or not isinstance(world, int) or not isinstance(profile, str) or comm is None:
        return None, "no planner projection (config.toml, summary.json's world_size and devices.name and a " \
                     "step's comm counts are needed): no check against the planned step time"
    from chipset.discovery.profiles import all_profiles
    from chipset.planner.projection import project
    from chipset.train.config import load_config

    if profile not in all_profiles():
        return None, f"no planner profile named {profile!r} (the run's device): no check against the planned step time"
    try:
        return project(load_config(config), world, comm, profile), None
    except (ChipsetError, ValueError, KeyError, AttributeError, TypeError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"the planner cannot project this run ({why[:160]}): no check against the planned step time"


def _groups(proj: dict) -> tuple[dict[str, str], dict[str, float]]:
    """(op -> term name, term -> predicted exposed seconds) from the projection's ``comm_ops``."""
    term_of, predicted = {}, {}
    for op, row in proj["comm_ops"].items():
        name = "+".join(sorted(row.get("dims") or [])) or "other"
        term_of[op] = name
        predicted[name] = predicted.get(name, 0.0) + float(row.get("exposed_s", row.get("seconds", 0.0)))
    if proj.get("bubble_s"):
        predicted["pp"] = predicted.get("pp", 0.0) + float(proj["bubble_s"])
    return term_of, predicted


def _measured(x: dict[str, Any], term_of: dict[str, str], world: int) -> dict[str, float] | None:
    if not all(isinstance(x.get(k), list) and len(x[k]) == world for k in ("compute_s", "comm_s", "idle_s")):
        return None
    data = x["data_wait_s"] if isinstance(x.get("data_wait_s"), list) and len(x["data_wait_s"]) == world else [0.0] * world
    out = {"compute": min(c - d for c, d in zip(x["compute_s"], data, strict=True)),
           "data": max(data), "idle": max(x["idle_s"])}
    r = max(range(world), key=lambda i: x["comm_s"][i])
    secs = {op: (t.get("seconds") or [0.0] * world)[r] for op, t in (x.get("comm") or {}).items()
            if len(t.get("seconds") or []) == world}
    total = sum(secs.values())
    for op, s in secs.items():
        name = term_of.get(op, "other")
        out[name] = out.get(name, 0.0) + (x["comm_s"][r] * s / total if total > 0 else 0.0)
    return out


def plan_check(run_dir: Path, recs: list[dict[str, Any]],
               summary: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(finding dicts, what was missing, notes) of the planned-step check."""
    rows = steady([x for x in recs if isinstance(x.get("compute_s"), list) and x["compute_s"]])
    if not rows:
        return [], [], []
    proj, why = _projection(run_dir, recs, summary)
    if proj is None:
        return [], [], [why]
    world = len(rows[0]["compute_s"])
    term_of, predicted = _groups(proj)
    predicted["compute"] = float(proj["compute_s"]) + float(proj.get("optimizer_s", 0.0)) + float(proj.get("host_s", 0.0))
    predicted.update(data=0.0, idle=0.0)
    steps = [(x, m) for x in rows if (m := _measured(x, term_of, world)) is not None]
    if not steps or predicted["compute"] <= 0:
        return [], [], []
    dev = summary.get("devices") or {}
    absolute = dev.get("estimated") is False and dev.get("name") == proj.get("profile")
    mean = {t: sum(m.get(t, 0.0) for _, m in steps) / len(steps) for t in set(predicted).union(*(m for _, m in steps))}
    k = 1.0 if absolute else mean["compute"] / predicted["compute"]
    planned = k * sum(predicted.values())
    step_s = [max(x.get("step_time_s_per_rank") or [x.get("step_time_s") or 0.0]) for x, _ in steps]
    over = [x["step"] for (x, _), s in zip(steps, step_s, strict=True) if s >= SLOWER * planned]
    if planned <= 0 or len(over) < SHARE * len(steps):
        return [], [], []
    gaps = {t: mean[t] - k * predicted.get(t, 0.0) for t in mean if absolute or t != "compute"}
    term = max(gaps, key=gaps.get)
    measured_step = sum(step_s) / len(step_s)
    mode = "absolute" if absolute else f"ratio (prediction x {k:.3g}, the measured over the predicted compute)"
    return [dict(
        kind="slower_than_plan", severity="warning", rank=None, step=over[0],
        title=f"step {measured_step / planned:.1f}x slower than the planner predicts "
              f"({measured_step:.3g} s vs {planned:.3g} s{'' if absolute else ' on this run' + chr(39) + 's compute clock'}); "
              f"the gap lies in {term}: {mean[term]:.3g} s measured vs {k * predicted.get(term, 0.0):.3g} s planned",
        evidence={"term": term, "measured_step_s": measured_step, "planned_step_s": planned, "ratio": measured_step / planned,
                  "mode": mode, "scale": k, "profile": proj.get("profile"),
                  "measured_s": {t: round(v, 6) for t, v in sorted(mean.items())},
                  "planned_s": {t: round(k * v, 6) for t, v in sorted(predicted.items())},
                  "gap_s": {t: round(v, 6) for t, v in sorted(gaps.items())},
                  "slow_steps": over, "first_step": over[0]},
        confidence=round(len(over) / len(steps), 3),
        advice=_ADVICE.get(term.split("+")[0], _ADVICE["comm"]).format(term=term))], [], []


_ADVICE = {
    "compute": "the device computes slower than its profile says: check its clocks and kernels (the profiler "
               "trace's operators, train.profile_steps), the dtype and train.compile",
    "idle": "ranks wait for a slower peer: see the straggler finding for the rank",
    "data": "the step waits for its batches: see the data_loader_stall finding",
    "pp": "the pipeline's point-to-point transfers and bubble take longer than planned: check the link between "
          "stages, raise parallel.micro_batches or use schedule interleaved_1f1b",
    "comm": "the {term} group's collectives take longer than the planner's link model: check that group's link "
            "(a slow or congested path), or lay the job out so that less crosses it ('chipset plan')",
}
