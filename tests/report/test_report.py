"""``chipset report``: a self-contained, offline HTML page with every plot; checked with a
pure-Python parser always, and in a real headless browser when /usr/bin/chromium exists."""

from __future__ import annotations

import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import forked_cli
import testenv
from chipset.cli.main import main
from chipset.report import PLOTS, load_run

CHROMIUM = Path("/usr/bin/chromium")
VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "embed", "source", "track", "wbr"}
SVG_SELF_CLOSING = {"rect", "line", "polyline", "circle", "path"}


class _Checker(HTMLParser):
    """Checks nesting (every element closed in order) and collects ids, tags and URL-bearing attributes."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: dict[str, str] = {}
        self.tags: dict[str, int] = {}
        self.refs: list[str] = []
        self.figure_svgs: dict[str, int] = {}
        self._figure: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if "id" in a:
            if a["id"] in self.ids:
                self.errors.append(f"duplicate id {a['id']}")
            self.ids[a["id"]] = tag
        for k in ("src", "href", "xlink:href", "data", "action"):
            if k in a:
                self.refs.append(a[k])
        if tag == "figure":
            self._figure = a.get("id")
        if tag == "svg" and self._figure:
            self.figure_svgs[self._figure] = self.figure_svgs.get(self._figure, 0) + 1
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag not in SVG_SELF_CLOSING | VOID:
            self.errors.append(f"unexpected self-closing <{tag}/>")

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else 'nothing'}>")
            return
        self.stack.pop()
        if tag == "figure":
            self._figure = None


def _write_run(d: Path, *, resume: bool = False) -> Path:
    """A run directory as chipset train writes it, 2 ranks, with a resume when asked."""
    d.mkdir(parents=True)
    steps = [1, 2, 3, 2, 3, 4] if resume else [1, 2, 3, 4]
    lines = []
    for s in steps:
        lines.append(json.dumps({
            "step": s, "loss": 5.0 - 0.1 * s, "grad_norm": 1.0, "lr": 0.01, "loss_scale": 1.0, "skipped": False,
            "tokens_per_s": 1000.0 + s, "step_time_s": 0.1, "peak_memory_bytes": 2000, "mfu": 0.01,
            "memory_bytes": [1000, 1100], "peak_memory_bytes_per_rank": [2000, 2100],
            "step_time_s_per_rank": [0.1, 0.1], "compute_s": [0.06, 0.07], "comm_s": [0.03, 0.03],
            "idle_s": [0.01, 0.0], "slowest_rank": 1,
            "comm": {"all_reduce": {"calls": [2, 2], "bytes": [8, 8], "seconds": [0.01, 0.01]},
                     "reduce_scatter": {"calls": [1, 1], "bytes": [4096, 4096], "seconds": [0.02, 0.02]}},
        }))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"final_loss": 4.6, "steps": 4, "tokens_per_s": 1002.0, "world_size": 2,
               "layout": {"dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "zero": 2}, "dtype": "float32",
               "recompute": "none", "backend": "cpu_sim", "peak_memory_bytes": [2000, 2100], "skipped_steps": 0,
               "params_digest": "ab" * 32, "mfu": 0.01,
               "devices": {"name": "sim-generic", "count_per_node": 8, "total_memory_bytes": 2**34,
                           "peak_flops": {"float32": 2e13}},
               "comm_totals": {"reduce_scatter": {"calls": 8, "bytes": 32768, "seconds": 0.16}}}
    # the checkpointer's keys: zero/empty when nothing happened
    summary.update(restarts=0, resumed_from=None, resumed_step=0, skipped_checkpoints=[], checkpoints_saved=[2, 4])
    if resume:
        summary.update(restarts=1, resumed_from="run/checkpoints/step-3", resumed_step=3)
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.toml").write_text("[train]\nsteps = 4\n")
    return d


def _check_html(text: str) -> _Checker:
    c = _Checker()
    c.feed(text)
    c.close()
    assert text.startswith("<!DOCTYPE html>")
    assert not c.errors, c.errors
    assert c.stack == [], f"unclosed elements: {c.stack}"
    # offline: no URL of any scheme, nothing loaded by reference
    assert not re.search(r"(https?:|ftp:|file:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), "external URL in report"
    assert c.refs == [], c.refs
    assert "@import" not in text and "url(" not in text
    for pid in PLOTS:
        assert c.ids.get(pid) == "figure", f"plot {pid} missing"
        assert c.figure_svgs.get(pid) == 1, f"plot {pid} has no svg"
    return c


def test_report_is_well_formed_offline_and_has_every_plot(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out), "--no-png"]) == 0
    assert f"{len(PLOTS)} plots" in capsys.readouterr().out
    text = out.read_text()
    c = _check_html(text)
    assert c.tags.get("polyline", 0) >= 8  # every plot has at least one line of data
    for fact in ("cpu_sim", "dp=2 tp=1 pp=1 ep=1 cp=1 zero=2", "sim-generic", "20 TFLOP/s", "reduce_scatter",
                 "rank 1", "slowest in 4 of 4 steps", "none recorded", "2, 4"):
        assert fact in text, fact


def test_report_lists_restarts_and_resumes(tmp_path):
    run = load_run(_write_run(tmp_path / "run", resume=True))
    assert any("resumed at step 2 after step 3" in r for r in run.restarts)
    assert "restarts: 1" in run.restarts and "resumed_step: 3" in run.restarts
    assert 'resumed_from: "run/checkpoints/step-3"' in run.restarts
    out = tmp_path / "r.html"
    assert main(["report", str(run.path), "--out", str(out), "--no-png"]) == 0
    assert "resumed at step 2 after step 3" in out.read_text()


def test_report_says_when_the_job_went_on_with_fewer_nodes(tmp_path):
    d = _write_run(tmp_path / "run", resume=True)
    summary = json.loads((d / "summary.json").read_text())
    summary["elastic"] = {"planned_world_size": 2, "world_size": 1, "planned_nodes": 2, "nodes": 1,
                          "planned_dp": 2, "dp": 1, "planned_micro_batches": 1, "micro_batches": 2,
                          "global_batch": 8, "micro_batch_size": 4}
    (d / "summary.json").write_text(json.dumps(summary))
    line = "elastic: ran on 1 of 2 planned node(s), world 2 -> 1, dp 2 -> 1, micro_batches 1 -> 2 (global batch 8 kept)"
    assert line in load_run(d).restarts
    out = tmp_path / "r.html"
    assert main(["report", str(d), "--out", str(out), "--no-png"]) == 0
    assert "elastic: ran on 1 of 2 planned node(s)" in out.read_text()


def test_report_of_a_folder_that_is_not_a_run_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a run directory" in err and "metrics.jsonl" in err


def test_report_of_a_real_resumed_run_with_pngs_when_matplotlib_is_installed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    train = ["train", "--run-dir", str(run_dir), "--set", "train.global_batch=2", "--set", "train.checkpoint_every=1"]
    # 2 steps with a checkpoint per step, then the same run directory to 3 steps: resumes at step 2
    for cmd in ([*train, "--set", "train.steps=2"], [*train, "--set", "train.steps=3"]):
        r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", *cmd], capture_output=True, text=True,
                           env=env, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    assert main(["report", str(run_dir)]) == 0  # reads files only: in this process, no interpreter to start
    out = capsys.readouterr().out
    text = (run_dir / "report.html").read_text()
    _check_html(text)
    assert "resumed_step: 2" in text and "resumed_from:" in text
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install 'chipset[matplotlib]'" in out
        pytest.skip("matplotlib is not installed: checked the note instead of the PNG plots")
    pngs = sorted(p.name for p in (run_dir / "report_png").glob("*.png"))
    assert pngs == sorted(f"{pid.removeprefix('plot-')}.png" for pid in PLOTS)
    assert all((run_dir / "report_png" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless-browser check needs /usr/bin/chromium "
                    "(Debian: apt-get install -y chromium); the pure-Python HTML checks above still ran")
def test_report_loads_in_a_real_headless_browser_with_every_plot_rendered_and_no_errors(tmp_path):
    run = _write_run(tmp_path / "run")
    out = tmp_path / "report.html"
    assert main(["report", str(run), "--out", str(out), "--no-png"]) == 0
    profile = tmp_path / "chromium-profile"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", out.as_uri()]
    r = forked_cli.run(cmd, capture_output=True, text=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    # The page's own script ran after layout and counted plots with a non-empty box.
    m = re.search(r'data-plots-rendered="(\d+)"', r.stdout)
    assert m, "the page's script did not run (no data-plots-rendered on <body>):\n" + r.stdout[:2000]
    assert int(m.group(1)) == len(PLOTS)
    for pid in PLOTS:
        assert f'id="{pid}"' in r.stdout
    console = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln]
    assert not console, console


def test_report_of_a_run_from_before_the_metrics_fields_still_has_every_plot(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 4.0, "grad_norm": 1.0, "lr": 0.01,
                                                   "tokens_per_s": 100.0, "step_time_s": 0.1,
                                                   "peak_memory_bytes": 1000}) + "\n")
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out), "--no-png"]) == 0
    text = out.read_text()
    _check_html(text)
    assert "config.toml not found" in text and "(no data)" in text
