"""``chipset diagnose RUN_DIR``: the run doctor. Reads what ``chipset train`` wrote and names the bottleneck.

Each finding is a :class:`Finding`: a kind, a severity (``error`` / ``warning`` / ``info``), a one-line
title, the evidence (numbers, steps, ranks), a confidence in [0, 1] and what to do. Findings come
ranked: severity first, then confidence. The rules read ``metrics.jsonl`` records, ``summary.json``,
``config.toml`` (the layout and planned-step checks) and the profiler traces under ``traces/``
(see docs/diagnose.md for how each is computed); a field a run did not record
makes its rule silent, and the diagnosis lists what was missing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chipset.diagnose import rules
from chipset.diagnose.layout import layout_check
from chipset.diagnose.model import moe_skew, replica_divergence
from chipset.diagnose.pipeline import pipeline_bubble
from chipset.diagnose.planned import plan_check
from chipset.diagnose.read import check_records, read_run
from chipset.diagnose.trace import trace_check

__all__ = ["Diagnosis", "Finding", "SEVERITIES", "check_layout", "diagnose_records", "diagnose_run"]

SEVERITIES = ("error", "warning", "info")
RULES = (rules.health, replica_divergence, rules.memory, rules.data_loader, rules.recompiles, rules.straggler,
         rules.stage_imbalance,
         pipeline_bubble, moe_skew, rules.communication)
"""In this order; findings of equal severity and confidence keep it (the sort is stable): what the
run computed (loss, gradients) before what it holds (memory) before how fast it went."""


@dataclass
class Finding:
    """One thing the doctor found."""

    kind: str
    severity: str
    title: str
    evidence: dict[str, Any]
    confidence: float
    advice: str
    rank: int | None = None
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Diagnosis:
    """The ranked findings of one run and what could not be read."""

    run_dir: str
    steps: int
    findings: list[Finding] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """What the run directory lacked (a file, a line, a field): the diagnosis is partial."""
    notes: list[str] = field(default_factory=list)
    """Checks that do not apply to this run (no planner profile for its device, a model the planner
    cannot plan): nothing was missing."""

    @property
    def has_error(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "steps": self.steps, "partial": bool(self.missing),
                "missing": self.missing, "notes": self.notes, "has_error": self.has_error,
                "findings": [f.to_dict() for f in self.findings]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        lines = [f"chipset diagnose: {self.run_dir} ({self.steps} steps recorded)"]
        if not self.findings:
            lines.append("  no findings: nothing in the recorded metrics stands out")
        for i, f in enumerate(self.findings, 1):
            lines.append(f"{i}. [{f.severity}] {f.title} (confidence {f.confidence:.2f})")
            lines.append("   evidence: " + ", ".join(f"{k}={_short(v)}" for k, v in f.evidence.items()))
            lines.append(f"   what to do: {f.advice}")
        for m in self.missing:
            lines.append(f"  partial: {m}")
        for m in self.notes:
            lines.append(f"  note: {m}")
        return "\n".join(lines)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 8:
        return json.dumps(v[:8])[:-1] + ", ...]"
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def diagnose_records(records: list[dict[str, Any]], summary: dict[str, Any] | None = None,
                     run_dir: str = "") -> Diagnosis:
    """The diagnosis of ``records`` (parsed metrics.jsonl lines, in order) and ``summary``."""
    summary = summary or {}
    records, missing = check_records(records)
    diag = Diagnosis(run_dir, len(records), missing=missing)
    for rule in RULES:
        found, missing = rule(records, summary)
        diag.findings += [Finding(**f) for f in found]
        diag.missing += missing
    _rank(diag)
    return diag


def _rank(diag: Diagnosis) -> None:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    diag.findings.sort(key=lambda f: (order[f.severity], -f.confidence))


def diagnose_run(run_dir: str | Path) -> Diagnosis:
    """Read a run directory and diagnose it; UsageError (exit 2) only when nothing can be read."""
    records, summary, missing = read_run(Path(run_dir))
    diag = diagnose_records(records, summary, str(run_dir))
    check_layout(diag, Path(run_dir), summary)
    if summary:
        found, lacked, notes = plan_check(Path(run_dir), check_records(records)[0], summary)
        diag.findings += [Finding(**f) for f in found]
        diag.missing += lacked
        diag.notes += notes
    found, lacked = trace_check(Path(run_dir), summary)
    diag.findings += [Finding(**f) for f in found]
    diag.missing += lacked
    _rank(diag)
    diag.missing = missing + diag.missing
    return diag


def check_layout(diag: Diagnosis, run_dir: Path, summary: dict[str, Any]) -> None:
    """Add the layout check of the run in ``run_dir`` (its config.toml against 'chipset plan') to ``diag``."""
    if not summary:
        return  # summary.json's absence is already in diag.missing
    comm = [f for f in diag.findings if f.kind == "communication_bound"]
    found, missing, notes = layout_check(run_dir, summary, bool(comm))
    diag.findings += [Finding(**f) for f in found]
    for f in found:
        for c in comm:  # the communication finding points at the layout that would communicate less
            c.evidence["planner_recommends"] = f["evidence"]["recommended"]
            c.advice += f"; 'chipset plan' recommends {f['evidence']['recommended']} here (see the layout finding)"
    _rank(diag)
    diag.missing += missing
    diag.notes += notes
