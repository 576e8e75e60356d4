"""The shapes ``chipset report`` relies on in metrics.jsonl and summary.json, checked before rendering.

Why: the page formats numbers (``f"{loss:.4f}"``), sums lists and walks tables; a file that is not
what ``chipset train`` writes (edited by hand, from another tool, cut short) would otherwise end in
a traceback half-way through. Each check raises UsageError (exit 2) naming the file, the line or
key, what was expected and what was found; a torn (not-JSON) line in metrics.jsonl stays tolerated,
since a killed rank leaves exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chipset.errors import UsageError

__all__ = ["check_record", "parse_summary"]

_NUMBER = (int, float)
# metrics.jsonl keys the page reads as numbers (None allowed where a value may be unknown).
_RECORD_NUMBERS = {"step": False, "loss": True, "grad_norm": True, "tokens_per_s": True, "mfu": True,
                   "peak_memory_bytes": True, "step_time_s": True, "slowest_rank": True}
_RECORD_LISTS = ("peak_memory_bytes_per_rank", "compute_s", "comm_s", "idle_s")
_RECORD_TABLES = ("comm",)
# summary.json keys the page reads, by the shape it expects.
_SUMMARY_NUMBERS = ("tokens_per_s", "world_size", "skipped_steps")
_SUMMARY_LISTS = ("peak_memory_bytes", "checkpoints_saved")
_SUMMARY_TABLES = ("layout", "devices", "comm_totals", "elastic")


def _kind(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", str: "string", list: "list", dict: "object"}.get(
        type(v), type(v).__name__)


def _is_number(v: Any, none_ok: bool = False) -> bool:
    return (v is None and none_ok) or (isinstance(v, _NUMBER) and not isinstance(v, bool))


def _fail(where: str, key: str, expected: str, v: Any, fix: str) -> None:
    shown = json.dumps(v)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise UsageError(f"{where}: {key!r} = {shown}: expected {expected}, found a {_kind(v)}; {fix}")


def check_record(rec: Any, path: Path, line: int) -> dict[str, Any]:
    """One parsed line of metrics.jsonl: a JSON object whose numeric keys hold numbers."""
    where = f"{path} line {line}"
    fix = "this is not a metrics.jsonl written by chipset train; fix or remove the line"
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object (one step's metrics), found a {_kind(rec)}; {fix}")
    for key, none_ok in _RECORD_NUMBERS.items():
        if key in rec and not _is_number(rec[key], none_ok):
            _fail(where, key, "a number", rec[key], fix)
    for key in _RECORD_LISTS:
        if key in rec and not (isinstance(rec[key], list) and all(_is_number(x, True) for x in rec[key])):
            _fail(where, key, "a list of numbers", rec[key], fix)
    for key in _RECORD_TABLES:
        if key in rec and not isinstance(rec[key], dict):
            _fail(where, key, "an object", rec[key], fix)
    return rec


def parse_summary(text: str, path: Path) -> dict[str, Any]:
    """summary.json's object; UsageError when it is empty, cut short, not an object or mis-shaped."""
    fix = (f"a run that was killed can leave it so: delete {path} (the report renders without it) "
           "or rerun the training")
    if not text.strip():
        raise UsageError(f"{path} is empty: expected the JSON object chipset train writes at the end of a run; {fix}")
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}, "
                         f"{len(text)} characters: cut short?); {fix}") from None
    if not isinstance(summary, dict):
        raise UsageError(f"{path}: expected a JSON object, found a {_kind(summary)}; {fix}")
    for key in _SUMMARY_NUMBERS:  # null: not known (a strict-JSON writer's NaN)
        if key in summary and not _is_number(summary[key], none_ok=True):
            _fail(str(path), key, "a number", summary[key], fix)
    for key in _SUMMARY_LISTS:
        v = summary.get(key)
        if v is not None and not (isinstance(v, list) and all(_is_number(x) for x in v)):
            _fail(str(path), key, "a list of numbers", summary[key], fix)
    for key in _SUMMARY_TABLES:
        if summary.get(key) is not None and not isinstance(summary[key], dict):
            _fail(str(path), key, "an object", summary[key], fix)
    for op, t in (summary.get("comm_totals") or {}).items():
        if not (isinstance(t, dict) and all(_is_number(t.get(k)) for k in ("calls", "bytes", "seconds"))):
            _fail(str(path), f"comm_totals.{op}", "an object of numbers calls, bytes, seconds", t, fix)
    return summary
