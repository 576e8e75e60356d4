"""The planner against published runs (docs/planner.md's table): fails when the error grows past
the documented bounds, so a cost-model change that predicts the published runs worse is caught."""

from __future__ import annotations

import dataclasses

from chipset.planner.published import (
    MEAN_ABS_ERROR_BOUND,
    RUNS,
    WORST_ROW_BOUND,
    predict,
    relative_errors,
)


def test_published_runs_stay_within_the_documented_error_bounds():
    errors = relative_errors()
    assert len(errors) == len(RUNS), f"profiles missing for: {set(r.label for r in RUNS) - set(errors)}"
    mean_abs = sum(abs(e) for e in errors.values()) / len(errors)
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert mean_abs <= MEAN_ABS_ERROR_BOUND, f"mean absolute error {mean_abs:.1%} > {MEAN_ABS_ERROR_BOUND:.0%}"
    assert abs(errors[worst]) <= WORST_ROW_BOUND, f"{worst}: {errors[worst]:+.1%} beyond {WORST_ROW_BOUND:.0%}"


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
        if r.attention_speed != 1.0 or r.train:
            assert "attn_impl" in r.notes or "optim" in r.notes, f"{r.label}: say where the stated kernels come from"


def _error(run) -> float:
    return predict(run).tflops_per_device / run.tflops - 1


def test_a_runs_stated_attention_kernel_and_optimizer_change_its_prediction():
    """The facts a row carries are used: without them the MosaicML H100 rows fall outside the
    goal again (the bound above would fail), and each one on its own slows the prediction."""
    mpt13 = next(r for r in RUNS if r.label == "MPT-13B H100, 8 GPUs")
    as_stated = _error(mpt13)
    fa2_class = _error(dataclasses.replace(mpt13, attention_speed=1.0))
    fused = _error(dataclasses.replace(mpt13, train={}))
    assert fa2_class > as_stated + 0.05 and fused > as_stated + 0.02, (as_stated, fa2_class, fused)
    ignored = _error(dataclasses.replace(mpt13, attention_speed=1.0, train={}))
    assert ignored > WORST_ROW_BOUND, f"{ignored:+.1%}: the row would pass without the facts it states"
