"""``chipset backends``: every installed backend, its status, and why one is selected."""

from __future__ import annotations

import json

from chipset._version import API_VERSION
from chipset.errors import BackendSelectionError


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="list installed backends, their status, which is selected and which could serve the installed torch build")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verbose", "-v", action="store_true", help="show tracebacks of plugins that failed")
    p.set_defaults(run=run)


def report() -> dict:
    from chipset.discovery.build import build_report
    from chipset.discovery.records import discover
    from chipset.discovery.select import select

    records = discover()
    try:
        sel = select(None, records)
        selected, reason = sel.record.name, sel.reason
    except BackendSelectionError as exc:
        selected, reason = None, str(exc).splitlines()[0]
    return {
        "api_version": f"{API_VERSION[0]}.{API_VERSION[1]}",
        "selected": selected,
        "selection_reason": reason,
        "backends": [r.to_dict() for r in records],
        "torch_build": build_report(records),
        "_records": records,
    }


def run(args) -> int:
    from chipset.discovery.build import explain

    rep = report()
    records = rep.pop("_records")
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    print(f"chipset plugin API {rep['api_version']}")
    rows = [("", "NAME", "STATUS", "PRIORITY", "API", "DISTRIBUTION", "REASON")]
    for r in records:
        mark = "*" if r.name == rep["selected"] else ""
        dist = f"{r.distribution} {r.version}" if r.distribution else "?"
        rows.append((mark, r.name, r.status, "" if r.priority is None else str(r.priority), r.api_version or "?", dist, r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:6], widths, strict=True)) + "  " + row[6])
    print()
    for line in explain(rep["torch_build"]):
        print(line)
    if rep["selected"]:
        print(f"selected: {rep['selected']} ({rep['selection_reason']})")
    else:
        print(f"selected: none ({rep['selection_reason']})")
    if args.verbose:
        for r in records:
            if r.traceback:
                print(f"\n--- {r.name}: {r.entry_point}\n{r.traceback}")
    return 0
