"""The planner against published runs (docs/planner.md's table): fails when the error grows past
the documented bounds, so a cost-model change that predicts the published runs worse is caught.
Rows with a documented ``gap`` are bounded on their own, each within GAP_ROW_BOUND."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from chipset.planner.published import (
    GAP_ROW_BOUND,
    MEAN_ABS_ERROR_BOUND,
    RUNS,
    WORST_ROW_BOUND,
    predict,
    relative_errors,
)
from chipset.planner.tables import doc_tables, main, update_doc

PAGE = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_published_runs_stay_within_the_documented_error_bounds():
    errors = relative_errors()
    assert len(errors) == len(RUNS), f"profiles missing for: {set(r.label for r in RUNS) - set(errors)}"
    gaps = {r.label for r in RUNS if r.gap}
    bounded = {k: v for k, v in errors.items() if k not in gaps}
    mean_abs = sum(abs(e) for e in bounded.values()) / len(bounded)
    worst = max(bounded, key=lambda k: abs(bounded[k]))
    assert mean_abs <= MEAN_ABS_ERROR_BOUND, f"mean absolute error {mean_abs:.1%} > {MEAN_ABS_ERROR_BOUND:.0%}"
    assert abs(bounded[worst]) <= WORST_ROW_BOUND, f"{worst}: {bounded[worst]:+.1%} beyond {WORST_ROW_BOUND:.0%}"
    for label in gaps:
        assert abs(errors[label]) <= GAP_ROW_BOUND, f"{label}: {errors[label]:+.1%} beyond {GAP_ROW_BOUND:.0%}"


def test_published_runs_name_their_source_and_what_they_leave_unstated():
    labels = [r.label for r in RUNS]
    assert len(labels) == len(set(labels)), "run labels must be unique (the errors are keyed by label)"
    sources = {r.source.split(",")[0] for r in RUNS}
    assert len(sources) >= 4, sources
    for r in RUNS:
        assert r.source and r.notes, f"{r.label}: source and notes are required"
        assert r.layout["dp"] * r.layout.get("tp", 1) * r.layout.get("pp", 1) * r.layout.get("cp", 1) == r.gpus, r.label
        if r.tokens_per_gpu is not None:
            assert r.tflops > 0 and r.tokens_per_gpu > 0, r.label
        if "update_bytes" in r.train:
            assert "optim" in r.notes, f"{r.label}: say where the stated optimizer comes from"
        if "recompute_early_stop" in r.train:
            assert "checkpointing" in r.notes, f"{r.label}: say which activation checkpointing the run used"


def test_the_known_gap_rows_really_are_outside_the_goal():
    """A row flagged as a gap that the model now predicts within 20% should lose its flag."""
    errors = relative_errors()
    for r in RUNS:
        if r.gap:
            assert abs(errors[r.label]) >= 0.195, f"{r.label} is within the goal now ({errors[r.label]:+.1%}): clear its gap"


def test_a_runs_stated_optimizer_is_charged():
    """A row's unfused optimizer (TrainSpec.update_bytes) slows its prediction: most where one
    micro-batch makes a step (MPT-13B on H100), little where a step has many."""
    def error(label, **change):
        run = dataclasses.replace(next(r for r in RUNS if r.label == label), **change)
        return predict(run).tflops_per_device / run.tflops - 1

    one_micro_batch = error("MPT-13B H100, 8 GPUs", train={}) - error("MPT-13B H100, 8 GPUs")
    many = error("MPT-30B H100, 8 GPUs", train={}) - error("MPT-30B H100, 8 GPUs")
    assert one_micro_batch > 0.03 and 0 < many < 0.005, (one_micro_batch, many)


def test_the_whole_mosaicml_sweep_stays_within_its_recorded_bounds():
    from chipset.planner.published_sweep import GROUP_BOUNDS, ROWS, errors

    res = errors()
    assert len(res) == len(ROWS) == 79
    for (prof, rec), bound in GROUP_BOUNDS.items():
        group = [abs(e) for row, e in res if row[0] == prof and row[6] == rec]
        assert len(group) >= 16, (prof, rec)
        mean = sum(group) / len(group)
        assert mean <= bound, f"{prof}, recompute {rec}: mean absolute error {mean:.1%} > {bound:.0%}"


def test_the_sweep_prints_every_row_and_a_summary_per_group(capsys):
    from chipset.planner.published_sweep import ROWS, main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| ") for line in out.splitlines()) == len(ROWS) + 1
    assert out.count("mean absolute error") == 4


def test_the_pages_tables_are_what_the_planner_predicts_now():
    """docs/planner.md shows the tables the code produces today: a cost-model change that moves
    a prediction fails here until the page is regenerated with the one command it names."""
    text = PAGE.read_text()
    assert update_doc(text, doc_tables()) == text, (
        "docs/planner.md's generated tables are stale: run python -m chipset.planner.tables --write docs/planner.md")


def test_write_regenerates_the_tables_in_place_and_refuses_a_page_without_markers(tmp_path, capsys):
    stale = tmp_path / "planner.md"
    text = PAGE.read_text()
    begin = text.index("<!-- table published")
    row = text.index("| GPT 1.7B", begin)
    stale.write_text(text[:row] + "| GPT 1.7B | stale |\n" + text[row:])
    assert main(["--write", str(stale)]) == 0
    assert stale.read_text() == text and "updated" in capsys.readouterr().out
    assert main(["--write", str(stale)]) == 0 and "already current" in capsys.readouterr().out
    bare = tmp_path / "bare.md"
    bare.write_text("# no tables here\n")
    assert main(["--write", str(bare)]) == 2
    err = capsys.readouterr().err
    assert "<!-- table published" in err and "found 0 and 0" in err
    assert bare.read_text() == "# no tables here\n"


def test_the_sweep_pairs_h100_and_a100_rows_of_the_same_model_and_sequence():
    """paired(): measured H100/A100 speed-up over the predicted one, for each model and sequence
    that ran on both devices, from the published tokens/s and the planner's predictions."""
    from chipset.planner.published_sweep import ROWS, _run, errors, paired

    pairs = dict(paired(errors()))
    assert len(pairs) == 37
    h = next(r for r in ROWS if r[:3] == ("h100-sxm", "7b", 4096))
    a = next(r for r in ROWS if r[:3] == ("a100-80g", "7b", 4096))
    predicted = predict(_run(h)).tokens_per_s / predict(_run(a)).tokens_per_s
    assert abs(pairs[("7b", 4096)] - (h[5] / a[5]) / predicted) < 1e-9


def test_chipset_plan_validation_prints_the_pages_tables_computed_now():
    """``chipset plan --validation`` is the CLI's way to the tables above: each one as the code
    computes it, under its title."""
    from conftest import run_cli

    r = run_cli("plan", "--validation")
    assert r.returncode == 0, r.stderr
    for name, body in doc_tables().items():
        assert body in r.stdout, name
    assert r.stdout.count("## ") == len(doc_tables()) and "docs/planner.md" in r.stdout


def test_a_reader_that_stops_early_ends_the_output_quietly():
    """``chipset plan --validation | head -1``: the closed pipe ends the command with 141 and
    no traceback. The reading end is closed before the command prints anything (its output
    would fit in a pipe's buffer otherwise)."""
    import subprocess
    import sys

    import testenv

    p = subprocess.Popen([sys.executable, "-m", "chipset.cli.main", "plan", "--validation"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=testenv.clean_env())
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
