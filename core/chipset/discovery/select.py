"""Backend selection: the rules users rely on.

- ``CHIPSET_BACKEND=name``: strict; that backend or an error (exit 2).
- ``CHIPSET_BACKEND=a,b,c``: ordered preference; the first that is ``ok``.
- unset: the highest-priority available hardware backend; simulators only when no
  hardware is available; a priority tie between hardware backends is an error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from chipset.discovery.records import BackendRecord, discover
from chipset.errors import BackendSelectionError, BackendUnavailableError

__all__ = ["Selection", "select", "parse_backend_env", "describe_records"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class Selection:
    record: BackendRecord
    reason: str


def describe_records(records: list[BackendRecord]) -> str:
    """One line per installed backend: name, status, reason."""
    if not records:
        return "  (no backends installed: pip install chipset-cpu-sim for the CPU simulator)"
    return "\n".join(f"  {r.name:<10} {r.status:<16} {r.reason}" for r in records)


def parse_backend_env(value: str | None) -> list[str] | None:
    """Parse CHIPSET_BACKEND; None when unset or blank. Raises on malformed values."""
    if value is None or not value.strip():
        return None
    names = [n.strip() for n in value.split(",")]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise BackendSelectionError(
            f"CHIPSET_BACKEND={value!r} is malformed: expected a backend name or a comma-separated "
            f"list of names (e.g. 'cuda' or 'cuda,cpu_sim'), found invalid item(s) {bad!r}."
        )
    return names


def select(name: str | None = None, records: list[BackendRecord] | None = None) -> Selection:
    """Choose a backend: ``name`` if given, else CHIPSET_BACKEND, else by priority."""
    records = discover() if records is None else records
    by_name: dict[str, list[BackendRecord]] = {}
    for r in records:
        by_name.setdefault(r.name, []).append(r)
    source = "argument" if name is not None else "CHIPSET_BACKEND"
    wanted = parse_backend_env(name if name is not None else os.environ.get("CHIPSET_BACKEND"))
    listing = "Installed backends:\n" + describe_records(records)

    if wanted is None:
        return _by_priority(records, listing)

    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise BackendSelectionError(
            f"unknown backend {unknown[0]!r} requested by {source}={','.join(wanted)}; "
            f"valid names: {', '.join(sorted(by_name)) or '(none installed)'}.\n{listing}"
        )
    for n in wanted:
        if len(by_name[n]) > 1:
            dists = ", ".join(r.distribution or "?" for r in by_name[n])
            raise BackendSelectionError(
                f"backend {n!r} is provided by more than one distribution ({dists}); uninstall all but one."
            )
    if len(wanted) == 1:
        rec = by_name[wanted[0]][0]
        if not rec.ok:
            raise BackendUnavailableError(
                f"backend {rec.name!r} was requested by {source}={wanted[0]} but is {rec.status}: {rec.reason}\n{listing}"
            )
        return Selection(rec, f"requested by {source}={wanted[0]}")
    skipped = []
    for n in wanted:
        rec = by_name[n][0]
        if rec.ok:
            why = f"first available in {source}={','.join(wanted)}"
            if skipped:
                why += " (skipped " + "; ".join(skipped) + ")"
            return Selection(rec, why)
        skipped.append(f"{rec.name}: {rec.status}: {rec.reason}")
    raise BackendUnavailableError(
        f"none of the backends in {source}={','.join(wanted)} is available.\n{listing}"
    )


def _by_priority(records: list[BackendRecord], listing: str) -> Selection:
    usable = [r for r in records if r.ok]
    hardware = [r for r in usable if not r.simulator]
    pool = hardware or [r for r in usable if r.simulator]
    if not pool:
        raise BackendUnavailableError(
            "no chipset backend is available. Install one (pip install chipset-cpu-sim for the CPU "
            f"simulator) or fix the reasons below.\n{listing}"
        )
    top = max(r.priority or 0 for r in pool)
    best = [r for r in pool if (r.priority or 0) == top]
    if len(best) > 1:
        names = ", ".join(r.name for r in best)
        raise BackendSelectionError(
            f"backends {names} are all available with the same priority {top}; "
            f"choose one with CHIPSET_BACKEND (e.g. CHIPSET_BACKEND={best[0].name}).\n{listing}"
        )
    chosen = best[0]
    if hardware:
        return Selection(chosen, f"highest-priority available hardware backend (priority {top})")
    others = [r for r in records if not r.simulator and r.status != "disabled"]
    why = "; ".join(f"{r.name}: {r.reason}" for r in others) or "no hardware backend installed"
    return Selection(chosen, f"no hardware backend available ({why}); using simulator {chosen.name}")
