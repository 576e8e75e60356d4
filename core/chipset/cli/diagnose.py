"""``chipset diagnose RUN_DIR [--json]``: the run doctor (ranked findings; exit 1 on an error finding)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "diagnose",
        help="name the bottleneck of a training run: stragglers, leaks, stalls, spikes, communication",
        description="Read a run directory written by 'chipset train' and print a ranked list of findings, "
        "each with its evidence, a confidence and what to do (docs/diagnose.md). Exit 1 when a finding "
        "of severity 'error' exists, 2 when nothing in the folder can be read, else 0.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory chipset train wrote")
    p.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.diagnose import diagnose_run

    diag = diagnose_run(args.run_dir)
    print(diag.to_json() if args.json else diag.to_text())
    return 1 if diag.has_error else 0
