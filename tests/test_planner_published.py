"""The planner against published runs (docs/planner.md's table): fails when the error grows past
the documented bounds, so a cost-model change that predicts the published runs worse is caught."""

from __future__ import annotations

from chipset.planner.published import MEAN_ABS_ERROR_BOUND, RUNS, WORST_ROW_BOUND, relative_errors


def test_published_runs_stay_within_the_documented_error_bounds():
    errors = relative_errors()
    assert len(errors) == len(RUNS), f"profiles missing for: {set(r.label for r in RUNS) - set(errors)}"
    mean_abs = sum(abs(e) for e in errors.values()) / len(errors)
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert mean_abs <= MEAN_ABS_ERROR_BOUND, f"mean absolute error {mean_abs:.1%} > {MEAN_ABS_ERROR_BOUND:.0%}"
    assert abs(errors[worst]) <= WORST_ROW_BOUND, f"{worst}: {errors[worst]:+.1%} beyond {WORST_ROW_BOUND:.0%}"
