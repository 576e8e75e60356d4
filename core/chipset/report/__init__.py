"""``chipset report RUN_DIR``: one self-contained HTML page about a training run.

Reads what ``chipset train`` wrote (``metrics.jsonl``, ``summary.json``, ``config.toml``)
and renders loss, throughput, MFU, memory, communication and the compute/communication/
idle split over steps as inline SVG, with the layout, the backend and its devices, and
restarts/resumes when the run recorded them. The page loads nothing from anywhere (no
CDN, fonts or images by URL), so it opens offline. PNG copies of the plots are written
too when matplotlib is installed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from chipset.errors import UsageError
from chipset.preflight import check_output_file, read_text_file
from chipset.report.checks import check_record, parse_summary
from chipset.report.svg import _num, line_chart

__all__ = ["PLOTS", "RL_PLOTS", "Run", "is_rl", "load_run", "plots_of", "render_html", "write_report", "write_pngs"]

PLOTS = {
    "plot-loss": "Loss",
    "plot-grad-norm": "Gradient norm",
    "plot-lr": "Learning rate",
    "plot-throughput": "Throughput (tokens/s)",
    "plot-mfu": "Model FLOPs utilisation",
    "plot-memory": "Peak device memory per rank",
    "plot-comm-bytes": "Communication bytes per step (all ranks)",
    "plot-comm-time": "Communication time per step (slowest rank)",
    "plot-time-split": "Step time: compute / communication / idle (mean over ranks)",
}
"""Every plot the page carries, by element id (each is present even when its data is not)."""
RL_PLOTS = {
    "plot-reward": "Reward: mean over the step's completions, and each reward's",
    "plot-rl": "KL to the reference, entropy per token, clip fraction",
    "plot-response-length": "Response length (tokens per completion)",
}
"""The plots added after PLOTS for a ``chipset rl`` run (its records have ``reward_mean``)."""
_METRICS = "the JSON lines chipset train writes (one object per step)"


@dataclass
class Run:
    """What a run directory holds."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    restarts: list[str] = field(default_factory=list)
    """Restarts and resumes: from summary.json keys and from steps that go back in metrics.jsonl."""


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; UsageError (exit 2) when it is not one."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not path.is_dir() or not metrics.is_file():
        raise UsageError(
            f"{str(path)!r} is not a run directory: expected a folder holding metrics.jsonl (written by "
            f"'chipset train --run-dir DIR'), found {'no such folder' if not path.is_dir() else 'no metrics.jsonl'}; "
            "pass the folder chipset train printed as its run directory"
        )
    run = Run(path)
    for n, line in enumerate(read_text_file(metrics, "metrics file", _METRICS).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            run.restarts.append(f"metrics.jsonl line {n} is not JSON (a rank was killed while writing?)")
            continue
        run.records.append(check_record(rec, metrics, n))
    if (path / "summary.json").is_file():
        summary = path / "summary.json"
        run.summary = parse_summary(read_text_file(summary, "summary", "the JSON object chipset train writes"),
                                    summary)
    if (path / "config.toml").is_file():
        run.config_text = read_text_file(path / "config.toml", "run config", "the TOML file chipset train writes")
    prev = None
    for rec in run.records:
        step = rec.get("step")
        if isinstance(step, int) and prev is not None and step <= prev:
            run.restarts.append(f"resumed at step {step} after step {prev} (steps went back in metrics.jsonl)")
        prev = step if isinstance(step, int) else prev
    # What the checkpointer records (restarts, resumed_from, resumed_step, resharded,
    # skipped_checkpoints); zero/empty values mean it did not happen.
    for key, value in run.summary.items():
        if any(w in key for w in ("restart", "resum", "reshard", "skipped_checkpoint")) and value not in (
                None, 0, "", [], {}):
            run.restarts.append(f"{key}: {json.dumps(value)}")
    # A job that lost nodes for good (chipset.train.elastic.WorldChange.to_dict()).
    el = run.summary.get("elastic")
    if isinstance(el, dict) and {"nodes", "planned_nodes", "world_size", "planned_world_size"} <= el.keys():
        run.restarts.append(
            f"elastic: ran on {el['nodes']} of {el['planned_nodes']} planned node(s), world "
            f"{el['planned_world_size']} -> {el['world_size']}, dp {el.get('planned_dp')} -> {el.get('dp')}, "
            f"micro_batches {el.get('planned_micro_batches')} -> {el.get('micro_batches')} "
            f"(global batch {el.get('global_batch')} kept)")
    return run


# --- series ------------------------------------------------------------------------
def is_rl(run: Run) -> bool:
    """Whether ``run`` is a ``chipset rl`` run (a record has ``reward_mean``)."""
    return any("reward_mean" in r for r in run.records)


def plots_of(run: Run) -> dict[str, str]:
    """The plots of ``run``'s page, element id -> title: PLOTS, and RL_PLOTS for an RL run."""
    return {**PLOTS, **RL_PLOTS} if is_rl(run) else PLOTS


def _series(run: Run) -> dict[str, dict[str, list[tuple[float, float]]]]:
    recs = run.records
    world = max((len(r.get("peak_memory_bytes_per_rank", [])) for r in recs), default=0)

    def pts(fn) -> list[tuple[float, float]]:
        out = []
        for r in recs:
            try:
                v = fn(r)
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if v is not None:
                out.append((r["step"], float(v)))
        return out

    rl = {}
    if is_rl(run):
        names = sorted({k[len("reward/"):-len("_mean")] for r in recs for k in r
                        if k.startswith("reward/") and k.endswith("_mean")})
        rl = {"plot-reward": {"reward": pts(lambda r: r["reward_mean"]),
                              **({n: pts(lambda r, n=n: r[f"reward/{n}_mean"]) for n in names} if len(names) > 1
                                 else {})},
              "plot-rl": {"KL": pts(lambda r: r["kl"]), "entropy": pts(lambda r: r["entropy"]),
                          "clip fraction": pts(lambda r: r["clip_frac"])},
              "plot-response-length": {"tokens": pts(lambda r: r["response_length"])}}
    return {**_train_series(recs, pts, world), **rl}


def _train_series(recs, pts, world) -> dict[str, dict[str, list[tuple[float, float]]]]:
    ops = sorted({op for r in recs for op in r.get("comm", {})})
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    memory = ({f"rank {i}": pts(lambda r, i=i: r["peak_memory_bytes_per_rank"][i]) for i in range(world)}
              if world else {"rank 0": pts(lambda r: r["peak_memory_bytes"])})
    return {
        "plot-loss": {"loss": pts(lambda r: r["loss"]),
                      **({"eval loss": ev} if (ev := pts(lambda r: r.get("eval_loss"))) else {})},
        "plot-grad-norm": {"grad norm": pts(lambda r: r["grad_norm"])},
        "plot-lr": {"lr": pts(lambda r: r["lr"])},
        "plot-throughput": {"tokens/s": pts(lambda r: r["tokens_per_s"])},
        "plot-mfu": {"MFU (%)": pts(lambda r: None if r.get("mfu") is None else 100 * r["mfu"])},
        "plot-memory": memory,
        "plot-comm-bytes": {op: pts(lambda r, op=op: sum(r["comm"][op]["bytes"]) if op in r["comm"] else 0)
                            for op in ops} or {"communication": []},
        "plot-comm-time": {op: pts(lambda r, op=op: max(r["comm"][op]["seconds"]) if op in r["comm"] else 0)
                           for op in ops} or {"communication": []},
        "plot-time-split": {
            "compute": pts(lambda r: mean(r["compute_s"])),
            "communication": pts(lambda r: mean(r["comm_s"])),
            "idle": pts(lambda r: mean(r["idle_s"])),
        },
    }


_UNITS = {"plot-memory": "bytes", "plot-comm-bytes": "bytes", "plot-comm-time": "seconds",
          "plot-time-split": "seconds", "plot-mfu": "%", "plot-throughput": "tokens/s"}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


# --- HTML ---------------------------------------------------------------------------
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1340px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0} td,th{border:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top}
th{background:#f4f4f4} .plots{display:flex;flex-wrap:wrap;gap:10px} figure.plot{margin:0}
svg .frame{fill:#fff;stroke:#999} svg .grid{stroke:#eee} svg text{font:11px sans-serif;fill:#333} svg text.t{font-size:13px;font-weight:600}
pre{background:#f7f7f7;padding:10px;overflow:auto} .muted{color:#777}
"""

# Marks the page as rendered: the count of plots with a non-empty layout box (the browser test reads it).
_SCRIPT = """
document.addEventListener("DOMContentLoaded", function () {
  var n = 0;
  document.querySelectorAll("figure.plot svg").forEach(function (s) {
    var b = s.getBoundingClientRect(); if (b.width > 0 && b.height > 0) n++;
  });
  document.body.setAttribute("data-plots-rendered", String(n));
});
"""


def _fixed(v: Any, digits: int) -> str:
    """A number with ``digits`` decimals; "?" when it is missing or null (not known)."""
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _findings(run: Run) -> str:
    """The run doctor's ranked findings (chipset diagnose, docs/diagnose.md) as a table."""
    from chipset.diagnose import check_layout, diagnose_records

    diag = diagnose_records(run.records, run.summary, str(run.path))
    check_layout(diag, run.path, run.summary)
    if not diag.findings:
        return '<p class="muted">no findings: nothing in the recorded metrics stands out (chipset diagnose)</p>'
    rows = "".join(
        f"<tr><td>{escape(f.severity)}</td><td>{escape(f.title)}</td><td>{f.confidence:.2f}</td>"
        f"<td>{escape(f.advice)}</td></tr>" for f in diag.findings)
    return ("<table><tr><th>severity</th><th>finding</th><th>confidence</th><th>what to do</th></tr>"
            f"{rows}</table>")


def render_html(run: Run) -> str:
    """The report page for ``run`` as one HTML string."""
    s, recs = run.summary, run.records
    last = recs[-1] if recs else {}
    layout = s.get("layout") or {}
    mfu = s.get("mfu")
    facts = [
        ("run directory", str(run.path)),
        ("backend", s.get("backend", "?")),
        ("world size", s.get("world_size", "?")),
        ("layout", " ".join(f"{k}={v}" for k, v in layout.items()) or "?"),
        ("dtype / recompute", f"{s.get('dtype', '?')} / {s.get('recompute', '?')}"),
        ("steps recorded", len(recs)),
        ("loss first -> final", f"{_fixed(recs[0].get('loss'), 4)} -> {_fixed(last.get('loss'), 4)}"
         if recs else "no steps"),
        *([("reward first -> final", f"{_fixed(recs[0].get('reward_mean'), 4)} -> "
            f"{_fixed(last.get('reward_mean'), 4)}")] if is_rl(run) else []),
        ("tokens/s (steady)", _fixed(s.get("tokens_per_s"), 0)),
        ("MFU (mean)", f"{100 * mfu:.3g} %" if isinstance(mfu, (int, float)) else "n/a (no declared peak)"),
        ("peak memory per rank", ", ".join(_bytes(x) for x in s.get("peak_memory_bytes") or []) or "?"),
        ("skipped steps", s.get("skipped_steps", "?")),
        ("checkpoints saved at steps", ", ".join(str(x) for x in s.get("checkpoints_saved") or []) or "none"),
        ("params digest", s.get("params_digest", "?")),
    ]
    dev = s.get("devices") or {}
    dev_rows = [("device", dev.get("name", "?")), ("devices per node", dev.get("count_per_node", "?")),
                ("memory per device", _bytes(dev["total_memory_bytes"]) if "total_memory_bytes" in dev else "?")]
    dev_rows += [(f"peak {k}", f"{v / 1e12:.4g} TFLOP/s") for k, v in (dev.get("peak_flops") or {}).items()]
    slow: dict[int, int] = {}
    for r in recs:
        if "slowest_rank" in r:
            slow[r["slowest_rank"]] = slow.get(r["slowest_rank"], 0) + 1
    comm_rows = [(op, f"{t['calls']} calls, {_bytes(t['bytes'])}, {t['seconds']:.4g} s")
                 for op, t in (s.get("comm_totals") or {}).items()]
    series = _series(run)
    plots = "\n".join(
        line_chart(pid, title, series[pid], y_label=_UNITS.get(pid, ""),
                   y_format=_bytes if _UNITS.get(pid) == "bytes" else _num)
        for pid, title in plots_of(run).items()
    )
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>chipset report: {escape(run.path.name)}</title>",
        f"<style>{_CSS}</style>", f"<script>{_SCRIPT}</script>", "</head><body>",
        f"<h1>chipset run report: {escape(run.path.name)}</h1>",
        '<p class="muted">Written by <code>chipset report</code> from metrics.jsonl, summary.json and config.toml. '
        "Definitions of every number: docs/observability.md.</p>",
        "<h2>Findings</h2>", _findings(run),
        "<h2>Run</h2>", _table(facts),
        "<h2>Backend and devices</h2>", _table(dev_rows),
        "<h2>Restarts and resumes</h2>",
        ("<ul>" + "".join(f"<li>{escape(x)}</li>" for x in run.restarts) + "</ul>") if run.restarts
        else '<p class="muted">none recorded</p>',
        "<h2>Over steps</h2>", f'<div class="plots">{plots}</div>',
        "<h2>Communication totals</h2>", _table(comm_rows) if comm_rows else '<p class="muted">no collectives</p>',
        "<h2>Slowest rank</h2>",
        _table([(f"rank {k}", f"slowest in {v} of {len(recs)} steps") for k, v in sorted(slow.items())])
        if slow else '<p class="muted">not recorded</p>',
        "<h2>Configuration</h2>", f"<pre>{escape(run.config_text or 'config.toml not found')}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_report(run_dir: str | Path, out: str | Path | None = None, *, png: bool = True) -> tuple[Path, list[Path]]:
    """Write the HTML report (default ``RUN_DIR/report.html``) and, with matplotlib, PNG plots.

    Returns the HTML path and the PNG paths (empty when matplotlib is not installed).
    """
    run = load_run(run_dir)
    target = Path(out) if out is not None else run.path / "report.html"
    check_output_file(target, "report", "--out FILE.html")  # before anything is written
    target.write_text(render_html(run), encoding="utf-8")
    pngs = write_pngs(run, target.parent / f"{target.stem}_png") if png else []
    return target, pngs


def write_pngs(run: Run, folder: Path) -> list[Path]:
    """One PNG per plot into ``folder`` when matplotlib can be imported; else nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    titles = plots_of(run)
    for pid, series in _series(run).items():
        fig, ax = plt.subplots(figsize=(6.4, 2.8), dpi=100)
        for name, pts in series.items():
            pts = [(x, y) for x, y in pts if math.isfinite(y)]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=name)
        ax.set_title(titles[pid])
        ax.set_xlabel("step")
        ax.set_ylabel(_UNITS.get(pid, ""))
        if any(series.values()):
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{pid.removeprefix('plot-')}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
