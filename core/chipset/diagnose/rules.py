"""The doctor's rules. Each takes (records, summary) and returns (finding dicts, missing notes).

Thresholds are ratios against the run's own peers or its own history (another rank in the same
step, the median of the previous steps), so they hold on any device speed.
"""

from __future__ import annotations

import math
from statistics import median

from chipset.errors import ConfigError
from chipset.parallel.dims import ParallelDims

MIB = 1024 * 1024
WARMUP = 1
"""Steps skipped at the start: the first step compiles, allocates optimizer state and warms caches."""
STRAGGLER_RATIO = 1.25
"""A rank is slow in a step when its compute time exceeds its slowest peer's by this factor."""
STRAGGLER_SHARE = 0.6
"""... in at least this share of the steady steps."""
LOSS_SPIKE = 1.5
GRAD_EXPLOSION = 10.0
COMM_BOUND = 0.5
"""Exposed communication above this share of the step time marks the step communication-bound."""
DATA_STALL = 0.2
NEAR_CAPACITY = 0.9
COMPILE_WARMUP = 2
"""Steps in which torch.compile is expected to compile: the first compiles every block, the second may
recompile each once (torch marks a size that changed as dynamic and compiles that graph again)."""
RECOMPILE_SHARE = 0.5
"""A recompilation storm: frames compiled in at least this share of the steps after COMPILE_WARMUP."""


def _lists(recs, key):
    return [r for r in recs if isinstance(r.get(key), list) and r[key]]


def steady(recs):
    """``recs`` without the warm-up steps (when more than WARMUP + 1 are left)."""
    return recs[WARMUP:] if len(recs) > WARMUP + 1 else recs


def stages(summary, world):
    """The pipeline stage of each of ``world`` ranks, from summary.json's layout (rank order of
    chipset.parallel.dims); None when the run has one stage or no readable layout."""
    lay = summary.get("layout") or {}
    if not isinstance(lay, dict) or lay.get("pp", 1) in (1, None):
        return None
    try:
        dims = ParallelDims(**{k: lay.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")},
                            zero=lay.get("zero", 0), world_size=world)
    except (ConfigError, TypeError):
        return None
    return [dims.coords(r)["pp"] for r in range(world)]


def _explains(rows, key, r, peer_ranks, world, extra) -> bool:
    """Whether rank ``r``'s mean excess of per-rank time ``key`` over its peers' largest explains over
    half of ``extra`` seconds (its excess compute time)."""
    diff = [x[key][r] - max(x[key][i] for i in peer_ranks)
            for x in rows if isinstance(x.get(key), list) and len(x[key]) == world]
    return bool(diff) and sum(diff) / len(diff) > 0.5 * extra


def _profiled(summary) -> tuple[int, int] | None:
    """summary.json's ``profiled_steps`` (the first and last step train.profile_steps profiled), or None."""
    p = summary.get("profiled_steps") or []
    return (p[0], p[-1]) if p and all(isinstance(x, int) for x in p) else None


def _unprofiled(rows, summary):
    """``rows`` without the profiled steps, whose compute carries the profiler's own start and
    buffers, a different cost on each rank; all of ``rows`` when every one was profiled."""
    p = _profiled(summary)
    kept = [x for x in rows if not p[0] <= x["step"] <= p[1]] if p else rows
    return kept or rows


def straggler(recs, summary):
    """Ranks compare with their peers: every other rank, or under pipeline parallelism the ranks of
    the same stage (stages do different work: stage_imbalance compares them). Profiled steps are
    left out (:func:`_unprofiled`)."""
    rows = _unprofiled(steady(_lists(recs, "compute_s")), summary)
    if not rows:
        return [], ["compute_s per rank not recorded: no straggler check"]
    world = len(rows[0]["compute_s"])
    if world < 2:
        return [], []
    stage = stages(summary, world)
    out = []
    for r in range(world):
        peer_ranks = [i for i in range(world) if i != r and (stage is None or stage[i] == stage[r])]
        if not peer_ranks:
            continue
        slow = [x for x in rows if x["compute_s"][r] > STRAGGLER_RATIO * max(x["compute_s"][i] for i in peer_ranks)]
        share = len(slow) / len(rows)
        if share < STRAGGLER_SHARE:
            continue
        mine = sum(x["compute_s"][r] for x in rows) / len(rows)
        peers = sum(max(x["compute_s"][i] for i in peer_ranks) for x in rows) / len(rows)
        extra = mine - peers
        cause = ("input pipeline" if _explains(rows, "data_wait_s", r, peer_ranks, world, extra) else
                 "host CPU contention" if _explains(rows, "cpu_wait_s", r, peer_ranks, world, extra) else
                 "device (compute)")
        ratio = mine / peers if peers > 0 else math.inf
        # A rank slowed by its own input is the data loader's finding (data_loader_stall has the
        # numbers); here it is a warning, so the stall ranks first. A rank whose thread waited for a
        # host CPU (other processes on the host's cores) is a warning too: its device is not slow.
        severe = ratio >= 1.5 and cause == "device (compute)"
        out.append(dict(
            kind="straggler", severity="error" if severe else "warning", rank=r, step=slow[0]["step"],
            title=f"rank {r} is a straggler: compute {ratio:.2f}x its slowest peer in {len(slow)} of "
                  f"{len(rows)} steady steps ({cause})",
            evidence={"rank": r, "cause": cause, "mean_compute_s": mine, "peer_compute_s": peers,
                      "ratio": ratio, "slow_steps": [x["step"] for x in slow], "first_step": slow[0]["step"],
                      "peer_idle_s": sum(sum(x["idle_s"]) for x in rows if "idle_s" in x) / len(rows)},
            confidence=round(share, 3),
            advice=(f"rank {r}'s input pipeline is slow (see data_loader_stall): raise data workers / "
                    "prefetch or move the data local"
                    if cause == "input pipeline" else
                    f"rank {r}'s training thread waited for a host CPU (cpu_wait_s): other processes compete for "
                    "the host's cores; give the job cores of its own (fewer ranks or threads per host, or move the "
                    "other work)"
                    if cause == "host CPU contention" else
                    f"rank {r}'s device is slower than its peers (thermal throttling, a shared or faulty "
                    "device, another process on it): check it and move the job off it")))
    return out, []


def stage_imbalance(recs, summary):
    rows = steady(_lists(recs, "compute_s"))
    stage = stages(summary, len(rows[0]["compute_s"])) if rows else None
    if stage is None:
        return [], []
    pp = max(stage) + 1
    # A stage's time in a step: its fastest rank's (a straggler inside a stage is the straggler rule's).
    per = [[min(x["compute_s"][r] for r in range(len(stage)) if stage[r] == k) for k in range(pp)] for x in rows]
    mean = [sum(p[k] for p in per) / len(per) for k in range(pp)]
    hi, lo = max(range(pp), key=lambda k: mean[k]), min(range(pp), key=lambda k: mean[k])
    if mean[lo] <= 0:
        return [], []
    ratio = mean[hi] / mean[lo]
    if ratio < STRAGGLER_RATIO:
        return [], []
    slowest = sum(max(range(pp), key=lambda k: p[k]) == hi for p in per) / len(per)
    ranks = [r for r in range(len(stage)) if stage[r] == hi]
    return [dict(
        kind="stage_imbalance", severity="warning", rank=ranks[0], step=rows[0]["step"],
        title=f"pipeline stage {hi} (ranks {', '.join(map(str, ranks))}) computes {ratio:.2f}x stage {lo}: "
              "the other stages wait for it",
        evidence={"stage": hi, "ranks": ranks, "stage_compute_s": mean, "ratio": ratio, "fastest_stage": lo,
                  "slowest_share": slowest},
        confidence=round(slowest, 3),
        advice=f"move work off stage {hi}: parallel.pipeline_split (units per stage) with fewer units there "
               "(the last stage also computes the head and the loss, the first the embedding); with one "
               "rank per stage a slow device looks the same, so check that rank's device too")], []


def memory(recs, summary):
    rows = steady(_lists(recs, "memory_bytes"))
    out, missing = [], []
    profiled = _profiled(summary)
    need = 3
    if profiled:
        # The profiler's own buffers grow the host memory from its first step on: not the run's.
        # What is left is the run's start, where the allocator still grows: read at least 3 intervals.
        rows, need = [x for x in rows if x["step"] < profiled[0]], 4
    if len(rows) < need:
        before = f" before the first profiled step ({profiled[0]})" if need == 4 else ""
        missing.append(f"fewer than {need} steady steps with memory_bytes{before}: no leak check")
    else:
        world = len(rows[0]["memory_bytes"])
        n = len(rows)
        for r in range(world):
            mem = [x["memory_bytes"][r] for x in rows if len(x["memory_bytes"]) == world]
            ups = sum(b > a for a, b in zip(mem, mem[1:], strict=False))
            rate = (mem[-1] - mem[0]) / (len(mem) - 1)
            if rate < 0.5 * MIB or ups < 0.8 * (len(mem) - 1):
                continue
            first = next(rows[i + 1]["step"] for i in range(len(mem) - 1) if mem[i + 1] > mem[i])
            out.append(dict(
                kind="memory_leak", severity="error", rank=r, step=first,
                title=f"rank {r} leaks memory: +{rate / MIB:.2f} MiB/step from step {first}",
                evidence={"rank": r, "mib_per_step": round(rate / MIB, 3), "first_step": first,
                          "grew_in_steps": ups, "steps": n, "start_mib": round(mem[0] / MIB, 2),
                          "end_mib": round(mem[-1] / MIB, 2)},
                confidence=round(ups / (len(mem) - 1), 3),
                advice="something keeps tensors alive across steps on this rank (a list of losses kept as "
                       "tensors, a growing cache, hooks holding activations): keep .item() values, "
                       "not tensors, and find the holder with a memory snapshot"))
    cap = (summary.get("devices") or {}).get("total_memory_bytes")
    peaks = _lists(recs, "peak_memory_bytes_per_rank")
    if isinstance(cap, (int, float)) and cap > 0 and peaks:
        near = [(x["step"], r, p) for x in peaks for r, p in enumerate(x["peak_memory_bytes_per_rank"])
                if p >= NEAR_CAPACITY * cap]
        if near:
            step, r, p = max(near, key=lambda t: t[2])
            out.append(dict(
                kind="memory_near_capacity", severity="error" if p >= 0.98 * cap else "warning", rank=r,
                step=step, title=f"{len(near)} rank-steps at >= {NEAR_CAPACITY:.0%} of device memory "
                                 f"(max {p / cap:.1%} on rank {r}, step {step})",
                evidence={"rank": r, "step": step, "peak_bytes": p, "capacity_bytes": cap,
                          "rank_steps_near": len(near)},
                confidence=1.0,
                advice="one larger batch or longer sequence runs out of memory: turn on train.recompute, "
                       "shard optimizer state (zero) or lower the micro-batch; 'chipset plan' shows the fit"))
    elif peaks:
        missing.append("device capacity not in summary.json: no near-capacity check")
    return out, missing


def _shares(rec, key: str) -> list[float]:
    """Each rank's ``rec[key]`` (seconds) as a share of its own step time (at most 1). A rank that
    waits in its first collective for a peer that started the step late has a longer step than
    rank 0's (``step_time_s``): against rank 0's time, one such step read as 13x on a loaded
    machine."""
    vals = rec[key]
    own = rec.get("step_time_s_per_rank")
    if not isinstance(own, list) or len(own) != len(vals):
        own = [rec["step_time_s"]] * len(vals)  # metrics written before the per-rank times
    return [min(1.0, v / t) if t > 0 else 0.0 for v, t in zip(vals, own, strict=True)]


def data_loader(recs, summary):
    rows = steady([x for x in _lists(recs, "data_wait_s") if x.get("step_time_s")])
    if not rows:
        return [], []
    share = [max(_shares(x, "data_wait_s")) for x in rows]
    stalled = [x for x, s in zip(rows, share, strict=True) if s >= DATA_STALL]
    if len(stalled) < 0.5 * len(rows):
        return [], []
    mean = sum(share) / len(share)
    rank = max(range(len(rows[0]["data_wait_s"])), key=lambda r: sum(x["data_wait_s"][r] for x in rows))
    return [dict(kind="data_loader_stall", severity="error" if mean >= 0.5 else "warning", rank=rank,
                 step=stalled[0]["step"],
                 title=f"data loader stalls: {mean:.0%} of step time waiting for batches (worst rank {rank})",
                 evidence={"rank": rank, "mean_wait_share": mean, "stalled_steps": len(stalled),
                           "steps": len(rows), "first_step": stalled[0]["step"]},
                 confidence=round(len(stalled) / len(rows), 3),
                 advice="the input pipeline cannot keep up: pre-tokenize (chipset data), add loader "
                        "workers or prefetch, read from local disk")], []


def _spikes(recs, key, factor):
    hist, out = [], []
    for x in recs:
        v = x.get(key)
        if v is None and key in x and not x.get("skipped"):
            v = math.nan  # metrics.jsonl writes NaN and inf as null; a skipped fp16 step is skipped_steps'
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if not math.isfinite(v):
            out.append((x["step"], v, None))
        elif len(hist) >= 2 and v > factor * median(hist[-5:]):
            out.append((x["step"], v, median(hist[-5:])))
        if math.isfinite(v):
            hist.append(v)
    return out


def _worst(spikes):
    """The largest spike (a non-finite value first); ``(step, value, baseline, ratio)``."""
    rated = [(s, v, b, (v / b) if b else math.inf) for s, v, b in spikes]
    return max(rated, key=lambda t: (t[2] is None, t[3]))


def health(recs, summary):
    out = []
    loss_steps: list[int] = []
    for key, factor, kind, what in (("loss", LOSS_SPIKE, "loss_spike", "loss"),
                                    ("grad_norm", GRAD_EXPLOSION, "grad_norm_explosion", "gradient norm")):
        sp = _spikes(recs, key, factor)
        if not sp:
            continue
        step, v, base, ratio = _worst(sp)
        evidence = {"step": step, "value": v if math.isfinite(v) else str(v), "baseline": base,
                    "ratio": ratio if math.isfinite(ratio) else None, "spike_steps": [s[0] for s in sp],
                    "first_step": sp[0][0]}
        if kind == "loss_spike":
            loss_steps = evidence["spike_steps"]
        elif step in loss_steps:  # one event: the loss spike's finding carries the gradient norm
            out[0]["evidence"]["grad_norm"] = evidence["value"]
            out[0]["evidence"]["grad_norm_ratio"] = evidence["ratio"]
            continue
        out.append(dict(
            kind=kind, severity="error" if base is None or ratio >= 2 * factor else "warning", step=step,
            title=f"{what} spike at step {step}: {v:.4g}"
                  + (f" ({ratio:.1f}x the median of the 5 steps before)" if base else " (not finite)")
                  + (f"; {len(sp)} spikes from step {sp[0][0]}" if len(sp) > 1 else ""),
            evidence=evidence,
            confidence=1.0 if base is None else round(min(1.0, ratio / (2 * factor)), 3),
            advice="look at the batch of that step (bad or repeated data), lower the learning rate or "
                   "lengthen warmup, clip gradients (train.grad_clip), prefer bf16 over fp16"))
    skipped = [x["step"] for x in recs if x.get("skipped") is True]
    if skipped:
        share = len(skipped) / len(recs)
        out.append(dict(
            kind="skipped_steps", severity="error" if share > 0.25 else "warning", step=skipped[0],
            title=f"{len(skipped)} of {len(recs)} steps skipped (fp16 overflow), first at step {skipped[0]}",
            evidence={"skipped_steps": skipped, "share": share}, confidence=1.0,
            advice="fp16 overflows: a few at the start are the loss scaler finding its scale; many mean "
                   "the model needs bf16, a lower learning rate or gradient clipping"))
    return out, []


def communication(recs, summary):
    rows = steady([x for x in _lists(recs, "comm_s") if x.get("step_time_s")])
    if not rows:
        return [], []
    world = len(rows[0]["comm_s"])
    share = [sum(_shares(x, "comm_s")) / world for x in rows]
    bound = [x for x, s in zip(rows, share, strict=True) if s >= COMM_BOUND]
    if len(bound) < 0.5 * len(rows):
        return [], []
    ops: dict[str, float] = {}
    for x in rows:
        for op, t in (x.get("comm") or {}).items():
            ops[op] = ops.get(op, 0.0) + max(t.get("seconds") or [0.0])
    op = max(ops, key=ops.get) if ops else "?"
    per_rank = [sum(x["comm_s"][r] for x in rows) / len(rows) for r in range(world)]
    mean = sum(share) / len(share)
    layout = summary.get("layout") or {}
    return [dict(
        kind="communication_bound", severity="error" if mean >= 0.75 else "warning", step=bound[0]["step"],
        rank=max(range(world), key=lambda r: per_rank[r]),
        title=f"communication-bound: {mean:.0%} of step time is exposed communication, mostly {op}",
        evidence={"mean_comm_share": mean, "bound_steps": len(bound), "steps": len(rows), "top_collective": op,
                  "collective_seconds": ops, "comm_s_per_rank": per_rank,
                  "layout": " ".join(f"{k}={v}" for k, v in layout.items()) or None},
        confidence=round(len(bound) / len(rows), 3),
        advice=f"the {op} traffic is not hidden behind compute: check the link (a slow or congested "
               "group), overlap communication, raise the micro-batch count, or compare the layout with "
               "'chipset plan', which ranks layouts by predicted step time")], []



def recompiles(recs, summary):
    """``compiles`` per rank and step (``train.compile`` runs): compiling that goes on after warm-up."""
    rows = _lists(recs, "compiles")
    late = rows[COMPILE_WARMUP:]
    if len(late) < 2:
        return [], []
    world = len(rows[0]["compiles"])
    storm = [x for x in late if any(x["compiles"])]
    if len(storm) < RECOMPILE_SHARE * len(late):
        return [], []
    per_rank = [sum(x["compiles"][r] for x in late) for r in range(world)]
    rank = max(range(world), key=lambda r: per_rank[r])
    share = len(storm) / len(late)
    return [dict(
        kind="recompile_storm", severity="error" if share >= 0.9 else "warning", rank=rank, step=storm[0]["step"],
        title=f"torch.compile recompiles in {len(storm)} of {len(late)} steps after warm-up "
              f"({per_rank[rank]} frames on rank {rank}, from step {storm[0]['step']})",
        evidence={"rank": rank, "compiles_per_rank": per_rank, "storm_steps": [x["step"] for x in storm],
                  "steps": len(late), "first_step": storm[0]["step"], "warmup_steps": COMPILE_WARMUP},
        confidence=round(share, 3),
        advice="a compiled block's guards keep failing (a shape, dtype or Python value that changes every "
               "step: variable sequence lengths, a step counter read in forward): pad to a few fixed shapes, "
               "or mark the varying size dynamic; TORCH_LOGS=recompiles names the failing guard")], []
