"""Data parallel and ZeRO 0-3 on real processes equal one process on the same global batch.

One torchrun job (2 ranks, gloo through the default backend) runs every variant in turn
and saves what each rank saw; one single-process job runs the references. The tests
compare them. This file is also the job's script (``__main__`` below).

Tolerances: derived in tests/parity.py (fp32 reduction order for per-step losses and
gradient norms, AdamW's worst case for parameters), so they hold on any CPU. The same job
also runs deliberately wrong reductions (``WRONG_VARIANTS``: gradients summed instead of
averaged, one rank's gradients dropped) and the tests assert the checks reject them.
"""

from __future__ import annotations

import gc
import io
import math
import sys
from pathlib import Path

import pytest
import torch

import multirank
import parity
from multirank import merge as _merge

HERE = Path(__file__).resolve()
STEPS = 6
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    # grad_clip below the typical norm (~0.9) so clipping is active on every step.
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 7},
    "parallel": {"bucket_mb": 0.02},  # several buckets, so overlap and ordering are exercised
}

# name -> overrides (dp=2 job)
DP_VARIANTS = {
    "zero0": {"parallel": {"zero": 0}},
    "zero1": {"parallel": {"zero": 1}},
    "zero2": {"parallel": {"zero": 2}},
    "zero3": {"parallel": {"zero": 3}},
    "zero0_accum": {"parallel": {"zero": 0, "micro_batches": 2}},
    "zero2_accum": {"parallel": {"zero": 2, "micro_batches": 2}},
    "zero3_accum_full": {"parallel": {"zero": 3, "micro_batches": 2}, "train": {"recompute": "full"}},
    "zero1_selective": {"parallel": {"zero": 1}, "train": {"recompute": "selective"}},
    "zero2_offload": {"parallel": {"zero": 2, "offload_optimizer": True}},
    "zero1_bf16": {"parallel": {"zero": 1}, "train": {"dtype": "bfloat16"}},
}
REF_VARIANTS = {
    "ref": {},
    "ref_accum4": {"parallel": {"micro_batches": 4}},
    "ref_bf16": {"train": {"dtype": "bfloat16"}},
}
# name -> (overrides, fault): the dp=2 job runs these with a wrong gradient reduction.
WRONG_VARIANTS = {
    "zero0_sum": ({"parallel": {"zero": 0}}, "sum"),
    "zero2_sum": ({"parallel": {"zero": 2}}, "sum"),
    "zero0_drop": ({"parallel": {"zero": 0}}, "drop"),
    "zero2_drop": ({"parallel": {"zero": 2}}, "drop"),
}
MEMORY_STAGES = (0, 1, 2, 3)
N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


# --------------------------------------------------------------------------------------
# The job (runs under torchrun or as one process)
# --------------------------------------------------------------------------------------


def _run_variant(b, overrides: dict) -> dict:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, overrides)).validate(world_size=b.collective.world_size())
    gc.collect()
    b.memory.reset_peak_stats()
    base = b.memory.stats().allocated
    res = train(cfg, b, None, out=io.StringIO(), keep_params=True)
    peak = res.summary["peak_memory_bytes"][b.collective.rank()]
    return {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics],
            "params": res.params, "digest": res.summary["params_digest"], "peak_over_base": peak - base,
            "launch_log": res.launch_log}


def _static_memory(b, zero: int) -> int:
    """Bytes held by parameters, gradients and optimizer state right after the engine is built (bf16)."""
    from chipset.train import build
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, {"parallel": {"zero": zero}, "train": {"dtype": "bfloat16"}}))
    cfg.validate(world_size=b.collective.world_size())
    gc.collect()
    before = b.memory.stats().allocated
    engine, _, _ = build(cfg, b)
    gc.collect()
    held = b.memory.stats().allocated - before
    n = sum(p.numel() for p in engine.model.parameters())
    del engine
    gc.collect()
    return {"bytes": held, "numel": n}


def _overflow_run(b, zero: int, inject_step: int) -> dict:
    """fp16 with dynamic scaling; rank 1 (or 0 alone) overflows at ``inject_step``."""
    from chipset.train import build
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, {
        "parallel": {"zero": zero},
        "train": {"dtype": "float16", "hysteresis": 1, "initial_loss_scale": 1024.0, "loss_scale_window": 1000},
    })).validate(world_size=b.collective.world_size())
    engine, data, _ = build(cfg, b)
    rank = b.collective.rank()
    culprit = b.collective.world_size() - 1
    out = {"skipped": [], "scale": [], "changed": []}
    for step in range(4):
        before = engine.full_parameters()
        tokens, targets = data.batch(step, engine.dp_rank, engine.dp, device=engine.device)
        if step == inject_step and rank == culprit:
            saved = engine.scaler.scale
            engine.scaler.scale = math.inf  # the scaled loss (and every gradient) overflows
            engine.forward_backward(tokens, targets)
            engine.scaler.scale = saved
        else:
            engine.forward_backward(tokens, targets)
        stats = engine.step(1e-2)
        after = engine.full_parameters()
        out["skipped"].append(stats["skipped"])
        out["scale"].append(stats["loss_scale"])
        out["changed"].append(any(not torch.equal(before[k], after[k]) for k in before))
    return out


def _resumed_run(b, zero: int, dtype: str) -> dict:
    """Train 3 steps, take the engine's state, load it into a fresh engine, train steps 3..5."""
    from chipset.train import build
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, {"parallel": {"zero": zero}, "train": {"dtype": dtype}}))
    cfg.validate(world_size=b.collective.world_size())
    tr = cfg.train
    losses = []

    def run(engine, data, steps):
        for step in steps:
            tokens, targets = data.batch(step, engine.dp_rank, engine.dp, device=engine.device)
            loss = torch.tensor([engine.forward_backward(tokens, targets)])
            b.collective.all_reduce(loss, "avg", group=engine.group)
            engine.step(tr.lr)
            losses.append(float(loss))

    first, data, _ = build(cfg, b)
    run(first, data, range(3))
    state = first.state_dict()
    del first
    second, data, _ = build(cfg, b)  # fresh: initial weights again until the state is loaded
    second.load_state_dict(state)
    run(second, data, range(3, STEPS))
    return {"losses": losses, "params": second.full_parameters()}


def _digest_check(b) -> dict:
    """ZeRO-3 with several buckets: the digest is hashed one bucket at a time and equals the digest
    of the fully gathered model (runtime/digest.py)."""
    from chipset.runtime.digest import params_digest
    from chipset.train import build
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, {"parallel": {"zero": 3}})).validate(world_size=b.collective.world_size())
    engine, _, _ = build(cfg, b)
    it = engine.iter_full_parameters()
    next(it)
    gathered_at_first = sum(bucket.full is not None for bucket in engine.buckets)
    list(it)  # collective: every rank iterates to the end
    out = {"buckets": len(engine.buckets), "gathered_at_first": gathered_at_first,
           "gathered_after": sum(bucket.full is not None for bucket in engine.buckets),
           "digest": engine.params_digest(), "full_digest": params_digest(engine.full_parameters())}
    del engine
    gc.collect()
    return out


def _wrong_run(b, overrides: dict, fault: str) -> dict:
    """One variant with a broken gradient reduction: a negative control for the parity checks.

    ``sum``: every rank multiplies its gradient by the dp degree before the engine divides
    and reduces, so the result is the sum over ranks instead of the average. ``drop``: the
    last rank contributes zeros, as if its gradient were lost. Test-only: patched here,
    undone before returning.
    """
    from chipset.runtime import data_parallel

    orig = data_parallel.Bucket.launch_reduce
    last = b.collective.rank() == b.collective.world_size() - 1

    def broken(self):
        grads = [self.grad] if self.engine.zero <= 1 else [p.grad for p in self.params]
        for g in grads:
            if fault == "sum":
                g.mul_(self.engine.dp)
            elif last:
                g.zero_()
        orig(self)

    data_parallel.Bucket.launch_reduce = broken
    try:
        return _run_variant(b, overrides)
    finally:
        data_parallel.Bucket.launch_reduce = orig


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    results: dict = {"world_size": b.collective.world_size()}
    # Memory first, in a fresh process, so nothing from earlier variants is in the counts.
    results["memory"] = {z: _static_memory(b, z) for z in MEMORY_STAGES}
    variants = DP_VARIANTS if mode == "dp" else REF_VARIANTS
    gc.collect()
    start = b.memory.stats().allocated
    steps_seen: list[int] = []
    notify = b.collective.notify_step
    b.collective.notify_step = lambda step: (steps_seen.append(step), notify(step))
    for name, over in variants.items():
        results[name] = _run_variant(b, over)
        if name == next(iter(variants)):
            results["notified_steps"] = list(steps_seen)
    b.collective.notify_step = notify
    kept = sum(sum(t.numel() * t.element_size() for t in r["params"].values()) for r in
               (results[n] for n in variants))
    gc.collect()
    results["leaked_bytes"] = b.memory.stats().allocated - start - kept
    if mode == "dp":
        results["wrong"] = {name: _wrong_run(b, over, fault) for name, (over, fault) in WRONG_VARIANTS.items()}
        results["resumed"] = {z: _resumed_run(b, z, "float32") for z in (0, 2, 3)}
        results["resumed_bf16"] = _resumed_run(b, 1, "bfloat16")
        results["digest"] = _digest_check(b)
    results["overflow"] = {z: _overflow_run(b, z, inject_step=1) for z in ((0, 3) if mode == "dp" else (0,))}
    multirank.finish(b, results, out_path)


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(2)
    got = multirank.run_jobs(HERE, [{"dp": 2, "ref": 1}], tmp_path_factory.mktemp("parity"), timeout=300)
    return got["dp"], got["ref"]


def _assert_params_close(a: dict, b: dict) -> None:
    tr = BASE["train"]
    parity.assert_params_within_adam_bound(a, b, lrs=[tr["lr"]] * STEPS, beta1=0.9, beta2=0.95)


def _assert_run_matches(got: dict, want: dict) -> None:
    """The parity check: per-step losses and gradient norms (tight), parameters (AdamW bound)."""
    parity.assert_losses_close(got["losses"], want["losses"], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(got["grad_norms"], want["grad_norms"], n=N_REDUCE, depth=DEPTH)
    _assert_params_close(got["params"], want["params"])


@pytest.mark.parametrize("variant", ["zero0", "zero1", "zero2", "zero3"])
def test_dp2_losses_and_params_equal_single_process(runs, variant):
    dp, ref = runs
    assert dp["world_size"] == 2 and ref["world_size"] == 1
    _assert_run_matches(dp[variant], ref["ref"])
    # The loss really moved, so equality is not vacuous.
    assert ref["ref"]["losses"][-1] < ref["ref"]["losses"][0] - 0.05


def test_digest_unshards_one_bucket_at_a_time_and_equals_the_full_gathers(runs):
    d = runs[0]["digest"]
    assert d["buckets"] > 2, "the check needs several buckets"
    # While the first parameter is handed out, no bucket but its own is unsharded (ZeRO-3 frees
    # each after use), so the end-of-run digest never holds the whole model on a rank.
    assert d["gathered_at_first"] <= 1 and d["gathered_after"] == 0
    assert d["digest"] == d["full_digest"]


@pytest.mark.parametrize("variant", ["zero0_accum", "zero2_accum", "zero3_accum_full", "zero1_selective", "zero2_offload"])
def test_accumulation_recompute_and_offload_match_the_plain_run(runs, variant):
    dp, ref = runs
    _assert_run_matches(dp[variant], ref["ref"])


@pytest.mark.parametrize("variant", ["zero0", "zero2", "zero3", "zero0_accum"])
def test_gradient_communication_is_launched_during_backward(runs, variant):
    """Each bucket launches once per step, the first while other buckets still await gradients."""
    log = runs[0][variant]["launch_log"]
    assert len(log) >= 3, log
    assert sorted(i for i, _ in log) == list(range(len(log)))
    assert log[0][1] == len(log) - 1, log  # first launch: every other bucket still computing
    assert [pending for _, pending in log] == sorted((p for _, p in log), reverse=True)


def test_grad_accumulation_equals_the_larger_batch_in_one_process(runs):
    _, ref = runs
    _assert_run_matches(ref["ref_accum4"], ref["ref"])


@pytest.mark.parametrize("variant", list(WRONG_VARIANTS))
def test_parity_check_rejects_a_wrong_gradient_reduction(runs, variant):
    """Negative control: the same check on a run whose gradients were summed or lost one rank fails.

    Summing leaves AdamW's updates almost unchanged (scale invariance), so it must fail on
    the gradient norm; a dropped rank changes the gradient and fails the trajectory.
    """
    dp, ref = runs
    wrong = dp["wrong"][variant]
    with pytest.raises(AssertionError, match="gradient norm at step 0") as caught:
        parity.assert_grad_norms_close(wrong["grad_norms"], ref["ref"]["grad_norms"], n=N_REDUCE, depth=DEPTH)
    print(caught.value)
    with pytest.raises(AssertionError):
        _assert_run_matches(wrong, ref["ref"])
    # The correct run of the same layout passes the same check.
    right = dp[variant.split("_")[0]]
    _assert_run_matches(right, ref["ref"])
    rel = abs(right["grad_norms"][0] / ref["ref"]["grad_norms"][0] - 1)
    print(f"correct run: step-0 gradient norm relative difference {rel:.1e}, "
          f"allowed {parity.trajectory_rtol(N_REDUCE, DEPTH, 0):.1e}")


@pytest.mark.parametrize("variant", ["zero0", "zero1", "zero2", "zero3"])
def test_clipping_norm_equals_the_unsharded_norm(runs, variant):
    dp, ref = runs
    norms = dp[variant]["grad_norms"]
    parity.assert_grad_norms_close(norms, ref["ref"]["grad_norms"], n=N_REDUCE, depth=DEPTH)
    assert all(n > BASE["train"]["grad_clip"] for n in norms), "clipping must be active for this test to bite"


def test_bf16_tracks_fp32_within_bf16_tolerance(runs):
    """bf16 params/compute with fp32 masters: per-step losses within docs/formulas.md's bf16 rtol 1.6e-2."""
    _, ref = runs
    torch.testing.assert_close(ref["ref_bf16"]["losses"], ref["ref"]["losses"], rtol=1.6e-2, atol=0)
    assert ref["ref_bf16"]["losses"] != ref["ref"]["losses"]  # really ran in bf16


def test_fp16_overflow_skips_exactly_that_step_and_halves_the_scale(runs):
    dp, ref = runs
    for result in [*dp["overflow"].values(), *ref["overflow"].values()]:
        assert result["skipped"] == [False, True, False, False]
        assert result["changed"] == [True, False, True, True]
        assert result["scale"] == [1024.0, 512.0, 512.0, 512.0]


@pytest.fixture
def exact_memory():
    """Byte-level memory assertions need a backend that counts every tensor (cpu_sim does;
    the ``cpu`` backend reports the process's resident memory)."""
    import chipset

    how = chipset.backend().capabilities.memory_accounting
    if how != "exact":
        pytest.skip(f"backend declares memory_accounting={how!r}, not exact")


def test_zero_memory_follows_the_formulas(runs, exact_memory):
    """bf16 params + fp32 master/Adam (K=12): 16P, 4P+12P/N, 2P+14P/N, 16P/N bytes, within 10%."""
    dp, _ = runs
    n = 2
    mem = dp["memory"]
    psi = mem[0]["numel"]
    expect = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for z, want in expect.items():
        got = mem[z]["bytes"]
        assert abs(got - want) <= 0.10 * want, f"zero {z}: {got} bytes held, formula {want:.0f}"


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_engine_state_round_trip_resumes_exactly(runs, zero):
    dp, _ = runs
    got = dp["resumed"][zero]
    assert got["losses"] == dp[f"zero{zero}"]["losses"]
    for k, v in dp[f"zero{zero}"]["params"].items():
        assert torch.equal(got["params"][k], v), k


def test_engine_state_round_trip_keeps_bf16_masters(runs):
    dp, _ = runs
    # Resuming must restore the fp32 masters, not re-derive them from bf16 parameters.
    assert dp["resumed_bf16"]["losses"] == dp["zero1_bf16"]["losses"]
    for k, v in dp["zero1_bf16"]["params"].items():
        assert torch.equal(dp["resumed_bf16"]["params"][k], v), k


def test_every_step_notifies_the_collective(runs):
    dp, ref = runs
    assert dp["notified_steps"] == ref["notified_steps"] == list(range(STEPS))


def test_finished_engines_free_their_memory(runs, exact_memory):
    """Nothing but the returned parameters stays allocated after a run (hooks do not pin engines)."""
    dp, ref = runs
    assert abs(dp["leaked_bytes"]) < 4096 and abs(ref["leaked_bytes"]) < 4096, (dp["leaked_bytes"], ref["leaked_bytes"])


def test_higher_zero_stages_lower_peak_memory(runs, exact_memory):
    dp, _ = runs
    peaks = [dp[f"zero{z}"]["peak_over_base"] for z in range(4)]
    assert peaks[3] < peaks[0], peaks
    assert peaks[3] <= peaks[2] <= peaks[1] <= peaks[0], peaks


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
