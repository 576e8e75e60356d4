"""The pipeline-bubble rule: how long pipeline stages wait for their neighbours, against the
schedule's theory.

Measured bubble of a rank in a step: its seconds blocked in point-to-point ops (``comm.batch_p2p``,
``send``, ``recv`` of metrics.jsonl: a stage waiting for an activation or a gradient) over its
busy seconds (its step time, ``compute_s + comm_s + idle_s``, less that wait and its
``data_wait_s``). It is the quantity the theory gives, idle time over ideal time
(:func:`chipset.parallel.schedule.bubble_fraction`, docs/formulas.md): (p-1)/m for GPipe and
1F1B, (p-1)/(v·m) interleaved, max(p-1, 2p-1-m)/(3m) zero bubble, max(p-1, 4p-2-2m)/(6m) ZBV. Busy time includes the optimizer and the other collectives, which
the theory leaves out, so the measurement errs low.

A step's bubble is the smallest over its ranks: the rank that waited least relative to its work.
When stages are unequal the fast ones also wait for the slow one; that is ``stage_imbalance``'s
finding, and the slowest stage, which waits least, is what is measured here.
"""

from __future__ import annotations

from chipset.diagnose.rules import STRAGGLER_RATIO, steady
from chipset.parallel.schedule import bubble_fraction

P2P = ("batch_p2p", "send", "recv")
"""The ops a pipeline stage waits in for its neighbours (metrics' ``comm`` table)."""
SLOW_PIPELINE = STRAGGLER_RATIO
"""A step's pipeline (busy + wait) at least this factor of what the schedule allows for the same
busy time, busy·(1 + theory), is a step with excess bubble: the 25% margin the straggler rule
puts on a rank's compute, put on the pipeline's. In bubble terms: measured >= 1.25·(1 + theory) - 1."""
SHARE = 0.5
"""... in at least this share of the steady steps."""


def _schedule(summary):
    """(pp, micro-batches, virtual stages, schedule name) of the run, or None without a pipeline."""
    lay, pipe = summary.get("layout") or {}, summary.get("pipeline")
    pp = lay.get("pp") if isinstance(lay, dict) else None
    if not isinstance(pp, int) or pp < 2:
        return None
    if not (isinstance(pipe, dict) and isinstance(pipe.get("micro_batches"), int) and pipe["micro_batches"] > 0):
        return pp, None, None, None
    v = pipe.get("virtual_stages", 1)
    return pp, pipe["micro_batches"], v if isinstance(v, int) and v > 0 else 1, str(pipe.get("schedule", "?"))


def _step_bubble(x, world):
    """(bubble, rank, wait_s, busy_s) of the rank that waited least relative to its work in ``x``."""
    comm = x.get("comm") or {}
    if not any(op in comm for op in P2P) or not all(
            isinstance(x.get(k), list) and len(x[k]) == world for k in ("compute_s", "comm_s", "idle_s")):
        return None
    waits = [0.0] * world
    for op in P2P:
        secs = (comm.get(op) or {}).get("seconds") or []
        if len(secs) == world:
            waits = [w + s for w, s in zip(waits, secs, strict=True)]
    data = x.get("data_wait_s") if isinstance(x.get("data_wait_s"), list) and len(x["data_wait_s"]) == world else [0.0] * world
    best = None
    for r in range(world):
        busy = x["compute_s"][r] + x["comm_s"][r] + x["idle_s"][r] - waits[r] - data[r]
        if busy > 0 and (best is None or waits[r] / busy < best[0]):
            best = (waits[r] / busy, r, waits[r], busy)
    return best


def pipeline_bubble(recs, summary):
    shape = _schedule(summary)
    if shape is None:
        return [], []
    pp, m, v, name = shape
    if m is None:
        return [], ["summary.json has no pipeline.micro_batches (a run from before it was recorded): "
                    "no pipeline-bubble check"]
    theory = bubble_fraction(pp, m, v, name)
    rows = [x for x in recs if isinstance(x.get("compute_s"), list) and x["compute_s"]]
    world = len(rows[0]["compute_s"]) if rows else 0
    measured = [(x["step"], b) for x in steady(rows) if (b := _step_bubble(x, world)) is not None]
    if not measured:
        return [], ["no point-to-point wait times in metrics.jsonl (comm.batch_p2p): no pipeline-bubble check"]
    limit = SLOW_PIPELINE * (1 + theory) - 1
    over = [(s, b) for s, b in measured if b[0] >= limit]
    if len(over) < SHARE * len(measured):
        return [], []
    mean = sum(b[0] for _, b in measured) / len(measured)
    excess = sum(b[2] - theory * b[3] for _, b in measured) / len(measured)
    few = theory > SLOW_PIPELINE - 1  # the schedule's own bubble is large: more micro-batches shrink it
    formula = {"zero_bubble": "max(pp-1, 2*pp-1-m)/(3m)", "zbv": "max(pp-1, 4*pp-2-2m)/(6m)"}.get(name, "(pp-1)/(v*m)")
    return [dict(
        kind="pipeline_bubble", severity="warning", rank=None, step=over[0][0],
        title=f"pipeline bubble {mean:.0%} of busy time, {(1 + mean) / (1 + theory):.2f}x what the {name} schedule "
              f"allows (theory {formula} = {theory:.0%}) in {len(over)} of {len(measured)} steady steps",
        evidence={"measured_bubble": mean, "theory_bubble": theory, "limit": limit, "pp": pp, "micro_batches": m,
                  "virtual_stages": v, "schedule": name, "excess_wait_s_per_step": excess,
                  "over_steps": [s for s, _ in over], "first_step": over[0][0],
                  "least_waiting_rank": [b[1] for _, b in measured]},
        confidence=round(len(over) / len(measured), 3),
        advice="stages wait for each other longer than the schedule explains: the activations and gradients "
               "between stages move slowly or are not overlapped (check the link between stages; "
               "comm.batch_p2p in metrics.jsonl has the seconds per rank), or a stage's host overhead "
               "between micro-batches"
               + ("; with so few micro-batches the schedule's own bubble is large: raise "
                  "parallel.micro_batches or use schedule interleaved_1f1b" if few else ""))], []
