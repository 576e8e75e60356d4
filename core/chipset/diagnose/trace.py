"""Findings from the profiler traces ``train.profile_steps`` writes (``RUN_DIR/traces/rank<r>.json``,
Chrome trace format; chipset.train.metrics).

Operators: a trace with device activity (events of category ``kernel``, a GPU's or NPU's) counts
those; a trace without (the CPU and the simulator, where operators run on the host) counts the
``cpu_op`` events of the thread that ran ``chipset::forward`` (under pipeline parallelism
``chipset::stage<N>.forward``). An operator's self time is its
duration less that of the operators and chipset's collective ranges nested in it on the same thread.

- ``host_overhead``: a profiled step is its ``chipset::step`` range (the step after its data is
  fetched; in a trace without one, from its ``chipset::forward`` to the end of its last ``chipset::``
  range); the part of it
  inside no operator and no ``chipset::<collective>`` range (``chipset::wait`` included: an async
  collective's wait) is the host's time between kernels
  (Python, dispatch, a synchronisation, a sleep). A finding when that share is at least
  ``HOST_SHARE`` in at least half the (rank, step) spans. A rank that waits for a peer's host
  overhead waits inside a collective: the overhead shows on the rank that has it.
- ``top_operators`` (info): the operators with the most self time over every rank's trace
  (torch.distributed's ``c10d::`` operators left out: ``COMMUNICATION``), and for
  each the chipset kernel that covers it (``KERNEL_OF``) and whether the run's backend declares a
  faster implementation of that kernel (its registered kernels, ``chipset info``), or which other
  installed backends do.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

HOST_SHARE = 0.6
"""A profiled step is overhead-bound when at least this share of it is inside no operator and no collective."""
SHARE = 0.5
"""... in at least this share of the (rank, step) spans."""
TOP = 5
"""Operators listed by ``top_operators``."""
KERNEL_OF = (
    (r"cross_entropy|log_?softmax|nll_?loss", "cross_entropy"),
    (r"(^|::|_|\s)(mm|addmm|matmul|linear|bmm|gemm)(backward\d*)?\b", "linear"),
    (r"scaled_?dot_?product|flash|attention|softmax", "scaled_dot_product_attention"),
    (r"rms_?norm|rsqrt", "rms_norm"),
    (r"layer_?norm", "layer_norm"),
    (r"silu|swiglu", "swiglu"),
    (r"_foreach_|addcdiv|adam", "fused_adamw"),
    (r"grouped_mm", "grouped_mm"),
    (r"grouped_?mlp", "grouped_mlp"),
)
"""Operator name, lower case (a regular expression searched in it; autograd's backward nodes, e.g.
``MmBackward0``, included) -> the chipset kernel that implements that work; the first match wins."""


def _events(path: Path) -> list[dict[str, Any]] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, json.JSONDecodeError):
        return None
    ev = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(ev, list):
        return None
    return [e for e in ev if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]


def _is_forward(name: Any) -> bool:
    """A forward range of the loop: ``chipset::forward``, or a pipeline stage's ``chipset::stage<N>.forward``."""
    return re.fullmatch(r"chipset::(stage\d+\.)?forward", str(name)) is not None


def _ops(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    if kernels:
        return kernels
    main = {e.get("tid") for e in ev if _is_forward(e.get("name"))}
    return [e for e in ev if e.get("cat") == "cpu_op" and e.get("tid") in main]


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _self_times(ops: list[dict[str, Any]]) -> Counter:
    out: Counter = Counter()
    stack: list[dict[str, Any]] = []
    for e in sorted(ops, key=lambda e: (e.get("tid"), e["ts"], -e["dur"])):
        while stack and (stack[-1].get("tid") != e.get("tid") or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        if stack:
            out[stack[-1]["name"]] -= e["dur"]
        out[e["name"]] += e["dur"]
        stack.append(e)
    return out


def _gaps(ev: list[dict[str, Any]], ops: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(gap seconds, span seconds) of each profiled step in one rank's trace: its ``chipset::step`` range
    (the step after its data); in a trace without one, from its ``chipset::forward`` to the end of its
    last ``chipset::`` range that starts before the next step's forward."""
    ranges = sorted((e for e in ev if str(e.get("name", "")).startswith("chipset::")), key=lambda e: e["ts"])
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == "chipset::step"]
    if not spans:
        starts = [e["ts"] for e in ranges if e["name"] == "chipset::forward"]
        spans = [(lo, max(e["ts"] + e["dur"] for e in ranges if lo <= e["ts"] < nxt))
                 for lo, nxt in zip(starts, [*starts[1:], float("inf")], strict=True)]
    busy = [(e["ts"], e["ts"] + e["dur"]) for e in [*ops, *_collectives(ranges)]]
    return [((hi - lo - _union(busy, lo, hi)) / 1e6, (hi - lo) / 1e6) for lo, hi in spans if hi > lo]


_PHASES = ("chipset::step", "chipset::forward", "chipset::backward", "chipset::optimizer")
"""The loop's own ranges: a step's phases, not collectives (``chipset::stage<N>.*`` are phases too)."""


def _collectives(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """chipset's collective ranges (``chipset::all_reduce``, ``chipset::wait``, ...): its ranges that are no phase."""
    return [e for e in ev if str(e.get("name", "")).startswith("chipset::")
            and e["name"] not in _PHASES and "." not in e["name"]]


def _rank_of(path: Path) -> int:
    """The rank a trace file belongs to (``rank3.json`` -> 3)."""
    return int(re.sub(r"\D", "", path.name) or 0)


def trace_check(run_dir: Path, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(finding dicts, what was missing) from ``run_dir/traces``; nothing when the run was not profiled."""
    files = sorted((run_dir / "traces").glob("rank*.json"), key=_rank_of)
    if not files:
        return [], []
    gaps, self_t, missing = [], Counter(), []
    for path in files:
        ev = _events(path)
        if ev is None:
            missing.append(f"traces/{path.name} is not a Chrome trace (cut short?): left out")
            continue
        ops = _ops(ev)
        # A collective inside an operator (tensor parallelism's autograd functions, ZeRO's hooks in a
        # backward node) is not that operator's own time: nested ranges are subtracted, then dropped.
        # torch.distributed's own operators are left out too (COMMUNICATION).
        self_t.update({k: v for k, v in _self_times(ops + _collectives(ev)).items()
                       if not k.startswith(("chipset::", COMMUNICATION))})
        rank = _rank_of(path)
        gaps += [(rank, g, s) for g, s in _gaps(ev, ops)]
    out = []
    if gaps:
        over = [(r, g, s) for r, g, s in gaps if g >= HOST_SHARE * s]
        share = sum(g for _, g, _ in gaps) / sum(s for _, _, s in gaps)
        if len(over) >= SHARE * len(gaps):
            worst = max(over, key=lambda t: t[1] / t[2])
            out.append(dict(
                kind="host_overhead", severity="warning", rank=worst[0], step=None,
                title=f"host overhead: {share:.0%} of the profiled steps is inside no operator and no collective "
                      f"(the host between kernels; worst rank {worst[0]}, {worst[1] / worst[2]:.0%})",
                evidence={"gap_share": share, "gap_s": sum(g for _, g, _ in gaps), "span_s": sum(s for _, _, s in gaps),
                          "over_spans": len(over), "spans": len(gaps), "ranks_over": sorted({r for r, _, _ in over}),
                          "limit": HOST_SHARE},
                confidence=round(len(over) / len(gaps), 3),
                advice="the device waits for the host between operators: look at the gaps in the trace (Python work "
                       "per step, .item() or other synchronisations, logging, a slow hook); train.compile fuses "
                       "small operators and cuts their launches; a larger micro-batch gives each launch more work"))
    top = _top_operators(self_t, summary)
    if top:
        out.append(top)
    return out, missing


COMMUNICATION = "c10d::"
"""torch.distributed's operators (``c10d::recv_``, ``c10d::allreduce_``, ...): left out of ``top_operators``.
On a host backend their self time is mostly the wait for a peer, which the communication and pipeline
rules read; no kernel of this rank's makes it shorter."""


def _top_operators(self_t: Counter, summary: dict[str, Any]) -> dict[str, Any] | None:
    total = sum(v for v in self_t.values() if v > 0)
    if total <= 0:
        return None
    backend = summary.get("backend") if isinstance(summary.get("backend"), str) else None
    declared, owners = _declared_kernels(backend)
    rows = []
    for name, us in self_t.most_common(TOP):
        kernel = next((k for pat, k in KERNEL_OF if re.search(pat, name.lower())), None)
        if kernel is None:
            faster = None
        elif backend is not None and kernel in declared:
            faster = f"{backend} registers {kernel}"
        else:
            faster = (f"no faster {kernel} on {backend or 'this backend'}"
                      + (f" (registered by {', '.join(owners.get(kernel, []))})" if owners.get(kernel) else ""))
        rows.append({"operator": name, "self_s": round(us / 1e6, 6), "share": round(us / total, 4),
                     "kernel": kernel, "faster_kernel": faster})
    covered = [r for r in rows if r["kernel"] and backend and r["kernel"] in declared]
    return dict(
        kind="top_operators", severity="info", rank=None, step=None,
        title=f"profiled operators: {', '.join(_named(r) for r in rows[:3])} of self time; "
              f"{len(covered)} of the top {len(rows)} have a faster kernel on {backend or 'this backend'}",
        evidence={"operators": rows, "backend": backend, "backend_kernels": sorted(declared)},
        confidence=1.0,
        advice="the operators with the most self time are where kernel work pays: where a chipset kernel covers "
               "one and the backend registers no faster implementation, that kernel is the one to write "
               "(docs/writing-a-plugin.md); where one is registered, check the run used it (train.compile, dtype)")


def _named(row: dict[str, Any]) -> str:
    return f"{row['operator']} {row['share']:.0%}"


def _declared_kernels(backend: str | None) -> tuple[set[str], dict[str, list[str]]]:
    """(kernels ``backend`` declares, kernel -> the installed backends that declare it)."""
    from chipset.loader import list_backends

    owners: dict[str, list[str]] = {}
    declared: set[str] = set()
    for rec in list_backends():
        kernels = rec.descriptor.kernels if rec.descriptor is not None else ()
        for k in kernels:
            owners.setdefault(k, []).append(rec.name)
        if rec.name == backend:
            declared = set(kernels)
    return declared, owners
