"""Enumerate layouts, discard the invalid and those that do not fit, rank by predicted step time.

Degrees: every dp x tp x pp x cp = N (ep divides dp*cp and the expert count). Validity:
tp divides heads and kv_heads, pp is at most the layers (when it does not divide them the
stages hold ⌊l/p⌋ or ⌈l/p⌉ blocks, the first and last the lighter: stages.py), cp divides
the sequence, the global batch is divisible by dp x micro-batch; interleaved schedules need v
to divide the heaviest stage's blocks (l/p when p divides l) with every chunk holding a block
(or v = ⌈l/p⌉ when only the first and last stage are lighter: stages.interleave_depths), and a
micro-batch count divisible by pp (Megatron's condition). Options per layout: ZeRO 0..3
(only 0 when dp*cp = 1), recompute none/selective/full, schedule 1F1B/GPipe/interleaved
(only 1F1B when pp = 1), micro-batch any divisor of the per-replica batch up to
Assumptions.max_micro_batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chipset.errors import ConfigError, UsageError
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster
from chipset.planner.layout import RECOMPUTE, SCHEDULES, Layout, TrainSpec
from chipset.planner.memory import memory_per_device
from chipset.planner.model import ModelSpec
from chipset.planner.stages import interleave_depths
from chipset.planner.time import Prediction, evaluate

__all__ = ["SearchResult", "search", "parse_fix", "FIXABLE"]

FIXABLE = ("dp", "tp", "pp", "ep", "cp", "zero", "micro_batch", "schedule", "virtual_stages", "recompute",
           "sequence_parallel")
_FULL = ("dp", "tp", "pp", "cp", "zero", "micro_batch", "schedule", "recompute")


@dataclass
class SearchResult:
    """Ranked candidates and an account of everything discarded."""

    candidates: list[Prediction]
    """Layouts that fit, fastest first."""
    layouts_enumerated: int = 0
    """Degree combinations (dp, tp, pp, cp, ep) considered."""
    discarded: Counter = field(default_factory=Counter)
    """Reason -> number of degree combinations or configurations discarded for it."""
    configurations_evaluated: int = 0
    """Configurations (degrees x ZeRO x recompute x schedule x micro-batch) whose memory was computed."""
    out_of_memory: int = 0
    """Configurations that were valid but do not fit in device memory."""
    smallest_oom: Prediction | None = None
    """The least memory-hungry configuration that still did not fit (for the error message)."""
    fixed_only: Prediction | None = None
    """With --fix naming a full layout: its evaluation, whether it fits or not."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_fix(items: list[str]) -> dict[str, Any]:
    """``["parallel.tp=8,parallel.pp=4"]`` -> ``{"tp": 8, "pp": 4}`` (schedule ``interleaved-v4`` sets v)."""
    out: dict[str, Any] = {}
    for chunk in items:
        for item in filter(None, (x.strip() for x in chunk.split(","))):
            key, sep, value = item.partition("=")
            name = key.removeprefix("parallel.")
            if not sep or not key.startswith("parallel.") or name not in FIXABLE:
                raise ConfigError(f"--fix {item!r}: expected parallel.KEY=VALUE with KEY one of {', '.join(FIXABLE)}")
            if name == "schedule":  # the label of a plan (interleaved-v4) or chipset train's name
                sched, _, v = value.partition("-v")
                out["schedule"] = "interleaved_1f1b" if sched == "interleaved" else sched
                if v:
                    out["virtual_stages"] = _int(item, v)
                elif sched == "zbv":  # its two chunks per rank are part of the schedule
                    out["virtual_stages"] = 2
            elif name == "recompute":
                if value not in RECOMPUTE:
                    raise ConfigError(f"--fix {item!r}: recompute must be one of {', '.join(RECOMPUTE)}")
                out[name] = value
            elif name == "sequence_parallel":
                out[name] = value.lower() in ("1", "true", "yes")
            else:
                out[name] = _int(item, value)
    if out.get("schedule", "1f1b") not in SCHEDULES:
        raise ConfigError(f"--fix parallel.schedule={out['schedule']!r}: expected 1f1b, gpipe, interleaved-vN, "
                          "zero_bubble or zbv")
    if out.get("zero", 0) not in (0, 1, 2, 3):
        raise ConfigError(f"--fix parallel.zero={out['zero']}: expected a ZeRO stage 0, 1, 2 or 3")
    for k in ("dp", "tp", "pp", "ep", "cp", "micro_batch", "virtual_stages"):
        if k in out and out[k] < 1:
            raise ConfigError(f"--fix parallel.{k}={out[k]}: expected a positive integer")
    return out


def _int(item: str, value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ConfigError(f"--fix {item!r}: expected an integer value") from None
    if v < 0:
        raise ConfigError(f"--fix {item!r}: expected a non-negative integer")
    return v


def _check_fixed(m: ModelSpec, train: TrainSpec, n: int, fix: dict[str, Any], seq: int) -> None:
    """Errors (exit 2) for fixed values no layout can satisfy, quoting the numbers."""
    tp = fix.get("tp")
    if tp is not None and (m.heads % tp or m.kv % tp):
        ok = [d for d in _divisors(m.heads) if m.kv % d == 0]
        raise ConfigError(f"tp ({tp}) must divide heads ({m.heads}) and kv_heads ({m.kv}); "
                          f"tp values that divide both: {', '.join(map(str, ok))}")
    if fix.get("pp") and fix["pp"] > m.layers:
        raise ConfigError(f"pp ({fix['pp']}) must be at most layers ({m.layers}): every pipeline stage needs a block")
    if fix.get("cp") and seq % fix["cp"]:
        raise ConfigError(f"cp ({fix['cp']}) must divide the sequence length ({seq})")
    if fix.get("ep", 1) > 1 and (not m.is_moe or m.num_experts % fix["ep"]):
        raise ConfigError(f"ep ({fix['ep']}) must divide num_experts ({m.num_experts}) of a MoE model")
    prod = 1
    for k in ("dp", "tp", "pp", "cp"):
        prod *= fix.get(k, 1)
    if prod > n or n % prod:
        raise ConfigError(f"fixed degrees multiply to {prod}, which does not divide the {n} devices of the cluster")
    dp, b = fix.get("dp"), fix.get("micro_batch")
    if dp and train.global_batch % (dp * (b or 1)):
        raise ConfigError(f"global batch ({train.global_batch}) is not divisible by dp x micro-batch "
                          f"({dp} x {b or 1} = {dp * (b or 1)}); choose a global batch that is a multiple of it")


def _options(fix: dict[str, Any], key: str, values: list[Any]) -> list[Any]:
    return [fix[key]] if key in fix else values


def search(m: ModelSpec, train: TrainSpec, cl: Cluster, fix: dict[str, Any] | None = None,
           assumptions: Assumptions | None = None, seq_len: int | None = None) -> SearchResult:
    """Every valid layout of ``m`` on ``cl`` that fits, fastest first; the rest accounted for."""
    a = assumptions or Assumptions()
    fix = dict(fix or {})
    s = seq_len or m.seq_len
    n = cl.world_size
    m.validate()
    if train.global_batch < 1:
        raise ConfigError(f"global batch must be a positive number of sequences (found {train.global_batch})")
    _check_fixed(m, train, n, fix, s)
    res = SearchResult(candidates=[])
    full_fix = all(k in fix for k in _FULL)
    structurally_valid = 0
    for tp in _options(fix, "tp", _divisors(n)):
        for cp in _options(fix, "cp", _divisors(n // tp) if n % tp == 0 else []):
            for pp in _options(fix, "pp", _divisors(n // (tp * cp)) if n % (tp * cp) == 0 else []):
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fix and fix["dp"] != dp:
                    continue
                eps = [1]
                if m.is_moe:
                    eps = [e for e in _divisors(dp * cp) if m.num_experts % e == 0]
                for ep in _options(fix, "ep", eps):
                    res.layouts_enumerated += 1
                    reason = None
                    if m.heads % tp or m.kv % tp:
                        reason = "tp does not divide heads and kv_heads"
                    elif pp > m.layers:
                        reason = "pp exceeds layers"
                    elif s % cp:
                        reason = "cp does not divide the sequence length"
                    elif (dp * cp) % ep:
                        reason = "ep does not divide dp*cp"
                    elif train.global_batch % dp:
                        reason = "global batch not divisible by dp"
                    if reason:
                        res.discarded[reason] += 1
                        continue
                    structurally_valid += 1
                    _options_for(m, train, cl, a, s, res, fix, full_fix, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    if structurally_valid == 0:
        why = "; ".join(f"{k}: {v}" for k, v in res.discarded.most_common())
        raise ConfigError(f"no valid parallel layout of {m.name} on {n} devices ({why or 'nothing enumerated'}). "
                          "Change the device count, the global batch or the model's heads/layers.")
    # Ties (e.g. cp that costs nothing extra) go to the simpler layout.
    res.candidates.sort(key=lambda p: (p.step_time_s, p.layout.cp, p.layout.ep, p.layout.pp, p.layout.tp,
                                       p.layout.zero, RECOMPUTE.index(p.layout.recompute), p.memory.total))
    if not res.candidates and res.fixed_only is None and res.out_of_memory == 0:  # none got as far as memory
        why = "; ".join(f"{k}: {v}" for k, v in res.discarded.most_common())
        raise ConfigError(f"no layout of {m.name} on {n} devices can run with {fix} ({why or 'nothing enumerated'}). "
                          "Fix fewer settings or other values.")
    if not res.candidates and res.fixed_only is None:
        worst = res.smallest_oom
        detail = ""
        if worst is not None:
            detail = (f"; the smallest needs {worst.memory.total / 2**30:.1f} GiB per device, "
                      f"usable {worst.memory_limit_bytes / 2**30:.1f} GiB")
        raise UsageError(f"no layout of {m.name} fits in device memory on {n} x {cl.profile or cl.device.name} "
                         f"({res.out_of_memory} configurations tried{detail}). Add devices, use a device with "
                         "more memory, or shorten the sequence.")
    return res


def _options_for(m: ModelSpec, train: TrainSpec, cl: Cluster, a: Assumptions, s: int, res: SearchResult,
                 fix: dict[str, Any], full_fix: bool, **deg: int) -> None:
    dp, pp, cp = deg["dp"], deg["pp"], deg["cp"]
    local = train.global_batch // dp
    mbs = [b for b in range(1, min(local, a.max_micro_batch) + 1) if local % b == 0]
    zeros = [0, 1, 2, 3] if dp * cp > 1 else [0]
    scheds: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        scheds.append(("gpipe", 1))
        scheds += [("interleaved_1f1b", v) for v in interleave_depths(m.layers, pp)]
        # The zero-bubble schedules are planned when asked for; their step time is not yet validated
        # against measured runs, so they are never proposed.
        if fix.get("schedule") == "zero_bubble":
            scheds.append(("zero_bubble", 1))
        if fix.get("schedule") == "zbv":
            scheds.append(("zbv", 2))
    if "schedule" in fix or "virtual_stages" in fix:
        want_s = fix.get("schedule")
        want_v = fix.get("virtual_stages")
        scheds = [(sc, v) for sc, v in scheds if (want_s is None or sc == want_s) and (want_v is None or v == want_v)]
        if not scheds and full_fix:
            scheds = [(fix["schedule"], fix.get("virtual_stages", 1))]
    for b in _options(fix, "micro_batch", mbs):
        if local % b:
            res.discarded["global batch not divisible by dp x micro-batch"] += 1
            continue
        micro = local // b
        for sched, v in scheds:
            if sched == "interleaved_1f1b" and micro % pp:
                res.discarded["interleaved schedule needs micro-batches divisible by pp"] += 1
                if not full_fix:
                    continue
            if sched == "zbv" and m.layers % (2 * pp):
                res.discarded["zbv planned only when 2 x pp divides the blocks"] += 1
                if not full_fix:
                    continue
            for zero in _options(fix, "zero", zeros):
                for rc in _options(fix, "recompute", list(RECOMPUTE)):
                    lay = Layout(**deg, zero=zero, micro_batch=b, schedule=sched, virtual_stages=v, recompute=rc,
                                 sequence_parallel=fix.get("sequence_parallel", True))  # recommended on with tp
                    res.configurations_evaluated += 1
                    mem = memory_per_device(m, lay, train, s)
                    limit = cl.device.total_memory * a.memory_usable_fraction
                    if full_fix:
                        res.fixed_only = evaluate(m, lay, train, cl, a, s, memory=mem)
                        if mem.total <= limit:
                            res.candidates.append(res.fixed_only)
                        else:
                            res.out_of_memory += 1
                        continue
                    if mem.total > limit:
                        res.out_of_memory += 1
                        res.discarded["does not fit in device memory"] += 1
                        if res.smallest_oom is None or mem.total < res.smallest_oom.memory.total:
                            res.smallest_oom = evaluate(m, lay, train, cl, a, s, memory=mem)
                        continue
                    res.candidates.append(evaluate(m, lay, train, cl, a, s, memory=mem))
