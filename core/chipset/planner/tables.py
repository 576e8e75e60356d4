"""The generated tables of docs/planner.md: the planner against published runs, the MosaicML sweep
and steps timed on an H200, written between their markers in place.

``python -m chipset.planner.tables --write docs/planner.md`` regenerates them; ``chipset plan
--validation`` prints them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from chipset.planner import measured_steps, published_sweep
from chipset.planner.cluster import list_profiles
from chipset.planner.published import RUNS, table

__all__ = ["TABLE_TITLES", "doc_tables", "update_doc", "main"]

_BEGIN, _END = "<!-- table {} (generated: python -m chipset.planner.tables --write) -->", "<!-- end table {} -->"


TABLE_TITLES = {"published": "Published training runs (python -m chipset.planner.published)",
                "sweep": "The whole MosaicML sweep (python -m chipset.planner.published_sweep)",
                "h200-steps": "Training steps timed on an H200 (python -m chipset.planner.measured_steps)"}
"""Each generated table's title, by the name its markers in docs/planner.md carry."""


def doc_tables(profiles=None) -> dict[str, str]:
    """Name -> Markdown of every generated table in docs/planner.md."""
    profiles = list_profiles() if profiles is None else profiles
    out = {"published": table(profiles), "sweep": published_sweep.table(published_sweep.errors(profiles))}
    if measured_steps.PROFILE in profiles:
        out["h200-steps"] = measured_steps.table(profiles[measured_steps.PROFILE][1])
    return out


def update_doc(text: str, tables: dict[str, str]) -> str:
    """``text`` with the body between each table's begin and end markers replaced; a missing
    marker is a ValueError naming it."""
    for name, body in tables.items():
        begin, end = _BEGIN.format(name), _END.format(name)
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"expected one {begin!r} and one {end!r} line in the page; found "
                             f"{text.count(begin)} and {text.count(end)}")
        a = text.index(begin) + len(begin)
        b = text.index(end)
        text = text[:a] + "\n\n" + body + "\n\n" + text[b:]
    return text


def main(argv: list[str] | None = None) -> int:
    """Print every generated table, or (``--write PAGE``) regenerate them in PAGE in place."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m chipset.planner.tables",
                                 description="The planner's validation tables (docs/planner.md).")
    ap.add_argument("--write", metavar="PAGE", help="update the generated tables in PAGE (docs/planner.md) in place")
    args = ap.parse_args(argv)
    profiles = list_profiles()
    if not profiles.keys() & {r.profile for r in RUNS}:
        print("no profile of the published runs is installed (a100-80g, h100-sxm come with chipset-cuda)",
              file=sys.stderr)
        return 2
    if args.write is None:
        for name, body in doc_tables(profiles).items():
            print(f"## {TABLE_TITLES[name]}\n\n{body}\n")
        return 0
    page = Path(args.write)
    try:
        old = page.read_text()
        new = update_doc(old, doc_tables(profiles))
    except (OSError, ValueError) as exc:
        print(f"python -m chipset.planner.tables: {exc}", file=sys.stderr)
        return 2
    if new != old:
        page.write_text(new)
    print(f"{page}: tables {'updated' if new != old else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
