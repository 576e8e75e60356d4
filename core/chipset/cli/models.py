"""``chipset models``: every model family (built in and from ``chipset.models`` entry points)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list model families, the layouts each supports, and why one is unusable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verbose", "-v", action="store_true", help="show tracebacks of families that failed")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.models.registry import discover_families
    from chipset.parallel.plan import LAYOUTS

    records = discover_families()
    if args.json:
        print(json.dumps({"families": [r.to_dict() for r in records]}, indent=2))
        return 0
    rows = [("NAME", "STATUS", "LAYOUTS", "SOURCE", "REASON")]
    for r in records:
        lay = " ".join(x for x in LAYOUTS if r.family is not None and x in r.family.layouts) or "-"
        src = f"{r.source} ({r.distribution})" if r.distribution and r.source != "built-in" else r.source
        rows.append((r.name, r.status, lay, src, r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
    print('\nselect one with model.family = NAME, or model.family = "package.module:factory" (docs/models.md)')
    if args.verbose:
        for r in records:
            if r.traceback:
                print(f"\n--- {r.name}: {r.source}\n{r.traceback}")
    return 0
