"""chipset diagnose's model rules on synthetic records: MoE routing skew (``moe``) and data-parallel
replica divergence (``param_sum``)."""

from __future__ import annotations

from chipset.diagnose import diagnose_records


def _moe(ratios, *, choices=4096, experts=8, top=3, dropped=0.0):
    return [{"step": s, "loss": 5.0, "step_time_s": 1.0,
             "moe": [{"layer": 1, "max_over_mean": r, "top_expert": top, "dropped_share": dropped,
                      "choices": choices, "experts": experts}]}
            for s, r in enumerate(ratios, 1)]


def test_a_skewed_moe_layer_names_the_layer_and_its_busiest_expert():
    d = diagnose_records(_moe([1.1, 3.0, 3.0, 2.5, 3.0, 1.1]), {})
    f = d.findings[0]
    assert (f.kind, f.severity, f.step) == ("moe_routing_skew", "warning", 2)
    assert (f.evidence["layer"], f.evidence["expert"], f.evidence["skewed_steps"]) == (1, 3, [2, 3, 4, 5])
    assert f.confidence == 0.8  # 4 of the 5 steady steps (step 1 is warm-up)


def test_a_skew_that_drops_tokens_is_an_error():
    f = diagnose_records(_moe([3.0] * 6, dropped=0.3), {}).findings[0]
    assert (f.kind, f.severity) == ("moe_routing_skew", "error")


def test_moe_skew_within_the_noise_of_few_tokens_is_no_finding():
    """32 choices over 4 experts: mean 8, sigma sqrt(32 * 1/4 * 3/4) = 2.45; a busiest expert of 16
    (2x the mean) is 3.3 sigma, within the 4-sigma band; 24 (3x) is 6.5 sigma and a finding."""
    assert not diagnose_records(_moe([2.0] * 6, choices=32, experts=4), {}).findings
    assert diagnose_records(_moe([3.0] * 6, choices=32, experts=4), {}).findings[0].kind == "moe_routing_skew"


def test_a_balanced_router_or_a_brief_skew_is_no_finding():
    assert not diagnose_records(_moe([1.2] * 6), {}).findings
    assert not diagnose_records(_moe([1.2, 3.0, 1.2, 1.2, 1.2, 1.2]), {}).findings


def _sums(world, odd_from=None, odd=(), every=1):
    out = []
    for s in range(1, 7):
        rec = {"step": s, "loss": 5.0, "step_time_s": 1.0}
        if s % every == 0:
            rec["param_sum"] = [100.0 + s + (0.001 if odd_from and s >= odd_from and r in odd else 0.0)
                                for r in range(world)]
        out.append(rec)
    return out


def test_replicas_that_diverge_name_the_first_step_and_the_odd_rank():
    f = diagnose_records(_sums(4, odd_from=3, odd=(2,)), {"layout": {"dp": 4}}).findings[0]
    assert (f.kind, f.severity, f.step, f.rank) == ("replica_divergence", "error", 3, 2)
    assert f.evidence["ranks"] == [2] and f.evidence["last_equal_step"] == 2 and f.evidence["diverged_checks"] == 4


def test_two_diverged_replicas_name_both_ranks_and_no_culprit():
    f = diagnose_records(_sums(2, odd_from=5, odd=(1,), every=2), {"layout": {"dp": 2}}).findings[0]
    assert (f.kind, f.step, f.rank, f.evidence["ranks"]) == ("replica_divergence", 6, None, [0, 1])


def test_ranks_holding_different_parts_of_the_model_are_not_compared():
    """dp=2 x tp=2: ranks 0 and 1 are tp peers (different shards), 0 and 2 replicas; with ep=2 over
    dp=2, the two dp ranks hold different experts and nothing is replicated over dp in whole."""
    recs = _sums(4, odd_from=1, odd=(1, 3))
    assert not diagnose_records(recs, {"layout": {"dp": 2, "tp": 2}}).findings
    f = diagnose_records(recs, {"layout": {"dp": 4}}).findings[0]
    assert f.kind == "replica_divergence" and f.step == 1
    assert not diagnose_records(_sums(2, odd_from=1, odd=(1,)), {"layout": {"dp": 2, "ep": 2}}).findings
    d = diagnose_records(_sums(2, odd_from=1, odd=(1,)), {})
    assert not d.findings and any("no replica-divergence check" in m for m in d.missing)
