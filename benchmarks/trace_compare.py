"""Two sets of per-rank torch.profiler chrome traces side by side: where each rank's time went.

    python benchmarks/trace_compare.py CHIPSET_RUN/traces PLAIN_TRACES [--top 15]

Each directory holds ``rank{r}.json`` (``chipset train --set train.profile_steps=A:B`` writes
them under the run directory's ``traces/``; ``benchmarks/plain_torch_lm.py --profile-steps A:B
--trace-dir DIR`` writes the plain script's). For every rank present in both it prints the
recorded span of the busiest thread, the time that thread spent outside every recorded
event (Python between ops, when no enclosing range was recorded), and the operators with the largest summed self time (time in
the operator minus the operators it called), in milliseconds, A then B. The self times of
nested events are found from their timestamps per thread, so nothing is counted twice
(events that overlap without nesting, such as gloo's asynchronous sends, count as siblings).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def self_times(path: Path) -> tuple[dict[str, float], float, float]:
    """Summed self time (ms) per event name on the busiest thread, its span and uncovered time (ms)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    busiest = max(threads.values(), key=lambda evs: sum(e["dur"] for e in evs))
    busiest.sort(key=lambda e: (e["ts"], -e["dur"]))
    out: dict[str, float] = defaultdict(float)
    child: dict[int, float] = defaultdict(float)
    stack: list[dict] = []
    covered, reach = 0.0, float("-inf")  # the union of all events' intervals
    for e in busiest:
        end = e["ts"] + e["dur"]
        covered += max(0.0, end - max(e["ts"], reach))
        reach = max(reach, end)
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < end:
            stack.pop()
        if stack:
            child[id(stack[-1])] += e["dur"]
        stack.append(e)
    for e in busiest:
        out[e["name"]] += (e["dur"] - child[id(e)]) / 1e3
    start = min(e["ts"] for e in busiest)
    span = (max(e["ts"] + e["dur"] for e in busiest) - start) / 1e3
    return out, span, span - covered / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    ranks = sorted(p.stem for p in args.a.glob("rank*.json") if (args.b / p.name).exists())
    if not ranks:
        raise SystemExit(f"no rank*.json present in both {args.a} and {args.b}")
    for r in ranks:
        (sa, span_a, gap_a), (sb, span_b, gap_b) = self_times(args.a / f"{r}.json"), self_times(args.b / f"{r}.json")
        print(f"\n{r}: span {span_a:.1f} ms (A) vs {span_b:.1f} ms (B); outside every event "
              f"{gap_a:.1f} vs {gap_b:.1f} ms")
        print("| self time, ms | A | B |\n|---|---|---|")
        names = sorted(set(sa) | set(sb), key=lambda n: -max(sa.get(n, 0.0), sb.get(n, 0.0)))
        for n in names[:args.top]:
            print(f"| {n[:70]} | {sa.get(n, 0.0):.1f} | {sb.get(n, 0.0):.1f} |")


if __name__ == "__main__":
    main()
