"""Read a run directory for the doctor: tolerant of torn lines and missing files (a partial diagnosis),
UsageError (exit 2) only when nothing can be read."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from chipset.errors import UsageError


def read_run(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """``(records, summary, missing)``; missing lists, in words, what could not be read."""
    missing: list[str] = []
    records: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    metrics, summ = path / "metrics.jsonl", path / "summary.json"
    if not path.is_dir():
        found = "a file, not a folder" if path.exists() else "no such folder"
        raise UsageError(f"{str(path)!r} is not a run directory: {found}; pass the folder "
                         "'chipset train --run-dir DIR' wrote")
    if metrics.is_file():
        for n, line in enumerate(metrics.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                missing.append(f"metrics.jsonl line {n} is not JSON (torn: a rank killed while writing?); skipped")
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
            else:
                missing.append(f"metrics.jsonl line {n} is not a step record (no integer 'step'); skipped")
    else:
        missing.append("metrics.jsonl not found: no per-step findings")
    if summ.is_file():
        try:
            obj = json.loads(summ.read_text(encoding="utf-8", errors="replace"))
            summary = obj if isinstance(obj, dict) else {}
            if not summary:
                missing.append("summary.json is not a JSON object; ignored")
        except json.JSONDecodeError:
            missing.append("summary.json is not JSON (cut short?): no device capacity or skipped-step total")
    else:
        missing.append("summary.json not found (the run did not finish?): no device capacity")
    if not records and not summary:
        raise UsageError(
            f"{str(path)!r}: nothing to diagnose: expected metrics.jsonl step records or summary.json "
            f"(written by 'chipset train --run-dir DIR'), found: {'; '.join(missing)}")
    return records, summary, missing


PER_RANK = ("compute_s", "comm_s", "idle_s", "data_wait_s", "cpu_wait_s", "memory_bytes",
            "peak_memory_bytes_per_rank", "step_time_s_per_rank", "param_sum", "compiles")
"""Record fields that hold one number per rank."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _comm_ok(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(t, dict) and isinstance(t.get("seconds", []), list)
        and all(_number(x) for x in t.get("seconds", [])) for t in v.values())


def check_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records the rules can read, and what was left out, in words.

    A step recorded twice (a restarted run resumed from a checkpoint appends the steps after it
    again) keeps its later record; a per-rank field whose list is not one finite number per rank
    (the run's world size: the most common length) is left out of that step, as is a
    ``step_time_s`` that is not a positive number or a ``comm`` table of another shape.
    """
    missing: list[str] = []
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        by_step[rec["step"]] = rec
    twice = len(records) - len(by_step)
    if twice:
        missing.append(f"metrics.jsonl records {twice} step(s) more than once (a restart resumed from a "
                       "checkpoint?): the later record of each kept")
    lengths = Counter(len(r[k]) for r in by_step.values() for k in PER_RANK if isinstance(r.get(k), list))
    world = lengths.most_common(1)[0][0] if lengths else 0
    bad: dict[str, list[int]] = {}
    out = []
    for step in sorted(by_step):
        rec = dict(by_step[step])
        for k in PER_RANK:
            if k in rec and not (isinstance(rec[k], list) and len(rec[k]) == world
                                 and all(_number(x) for x in rec[k])):
                bad.setdefault(k, []).append(step)
                del rec[k]
        if "step_time_s" in rec and not (_number(rec["step_time_s"]) and rec["step_time_s"] > 0):
            bad.setdefault("step_time_s", []).append(step)
            del rec["step_time_s"]
        if "comm" in rec and not _comm_ok(rec["comm"]):
            bad.setdefault("comm", []).append(step)
            del rec["comm"]
        out.append(rec)
    for k, steps in bad.items():
        what = f"{world} finite numbers (one per rank)" if k in PER_RANK else (
            "a positive number" if k == "step_time_s" else "{op: {seconds: [...]}}")
        shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
        missing.append(f"metrics.jsonl: {k} is not {what} in {len(steps)} step(s) ({shown}); left out there")
    return out, missing
