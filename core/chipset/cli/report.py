"""``chipset report RUN_DIR [--out FILE.html]``: a self-contained HTML report of a training run."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write a self-contained HTML report (and PNG plots) of a training run",
        description="Render a run directory written by 'chipset train' (metrics.jsonl, summary.json, "
        "config.toml) as one offline HTML page: loss, throughput, MFU, memory and communication over "
        "steps, the layout, the backend and its devices, restarts and resumes. PNG copies of the plots "
        "are written beside it when matplotlib is installed.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory chipset train wrote")
    p.add_argument("--out", default=None, metavar="FILE.html", help="where to write the page (default RUN_DIR/report.html)")
    p.add_argument("--no-png", action="store_true", help="do not write PNG plots even if matplotlib is installed")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.report import load_run, plots_of, write_report

    html, pngs = write_report(args.run_dir, args.out, png=not args.no_png)
    n = len(plots_of(load_run(args.run_dir)))
    print(f"chipset report: wrote {html} ({n} plots, self-contained: open it in any browser, offline)")
    if pngs:
        print(f"chipset report: PNG plots in {pngs[0].parent}")
    elif not args.no_png:
        print("chipset report: no PNG plots (pip install 'chipset[matplotlib]' to get them)")
    return 0
