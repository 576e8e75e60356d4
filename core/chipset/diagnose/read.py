"""Read a run directory for the doctor: tolerant of torn lines and missing files (a partial diagnosis),
UsageError (exit 2) only when nothing can be read."""

from __future__ import annotations

import json
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
        raise UsageError(f"{str(path)!r} is not a run directory: no such folder; pass the folder "
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
