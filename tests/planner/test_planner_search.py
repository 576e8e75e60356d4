"""Search: validity with reasons, memory filtering, ranking, --fix, and monotonicity in bandwidth."""

from __future__ import annotations

import dataclasses

import pytest

from chipset.errors import ConfigError, UsageError
from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import PRESETS
from chipset.planner.search import parse_fix, search
from chipset.planner.time import evaluate

DEV = DeviceProperties(name="test", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 300e12},
                       memory_bandwidth=2e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)
TINY = PRESETS["tiny"]  # 4 heads, 2 kv heads, 2 layers


def test_invalid_layouts_are_counted_by_reason():
    res = search(TINY, TrainSpec(global_batch=16), Cluster(1, 8, DEV))
    # tp in {8} breaks heads/kv; tp in {4} breaks kv_heads=2; pp in {4, 8} exceeds layers=2
    assert res.discarded["tp does not divide heads and kv_heads"] > 0
    assert res.discarded["pp exceeds layers"] > 0
    for p in res.candidates:
        lay = p.layout
        assert lay.dp * lay.tp * lay.pp * lay.cp == 8
        assert TINY.heads % lay.tp == 0 and TINY.kv % lay.tp == 0 and lay.pp <= TINY.layers
        assert 16 % (lay.dp * lay.micro_batch) == 0
        assert p.fits


def test_candidates_are_ranked_by_predicted_step_time():
    res = search(PRESETS["llama2-7b"], TrainSpec(global_batch=32), Cluster(1, 8, DEV),
                 fix={"recompute": "selective"})
    times = [p.step_time_s for p in res.candidates]
    assert times == sorted(times) and len(times) > 5


def test_layouts_that_do_not_fit_are_discarded_and_counted():
    small = dataclasses.replace(DEV, total_memory=24 * 2**30)
    res = search(PRESETS["llama2-7b"], TrainSpec(global_batch=32), Cluster(1, 8, small), fix={"recompute": "full"})
    assert res.out_of_memory > 0 and res.discarded["does not fit in device memory"] == res.out_of_memory
    assert all(p.memory.total <= 24 * 2**30 * 0.9 for p in res.candidates)
    assert all(not (p.layout.zero == 0 and p.layout.tp == 1 and p.layout.pp == 1) for p in res.candidates)


def test_nothing_fits_is_a_usage_error_with_the_smallest_need():
    tiny_dev = dataclasses.replace(DEV, total_memory=2**30)
    with pytest.raises(UsageError, match="no layout of llama2-70b fits.*smallest needs"):
        search(PRESETS["llama2-70b"], TrainSpec(global_batch=8), Cluster(1, 8, tiny_dev),
               fix={"tp": 8, "recompute": "full"})


@pytest.mark.parametrize(("fix", "match"), [
    ({"tp": 8}, r"tp \(8\) must divide heads \(4\) and kv_heads \(2\); tp values that divide both: 1, 2"),
    ({"dp": 8, "micro_batch": 3}, r"global batch \(16\) is not divisible by dp x micro-batch \(8 x 3 = 24\)"),
    ({"pp": 3}, r"pp \(3\) must be at most layers \(2\)"),
    ({"dp": 16}, "do(es)? not divide the 8 devices"),
])
def test_impossible_fixed_values_are_config_errors(fix, match):
    with pytest.raises(ConfigError, match=match):
        search(TINY, TrainSpec(global_batch=16), Cluster(1, 8, DEV), fix=fix)


def test_a_global_batch_no_dp_divides_is_an_error():
    with pytest.raises(ConfigError, match="global batch not divisible by dp"):
        search(TINY, TrainSpec(global_batch=7), Cluster(1, 8, DEV), fix={"tp": 1, "pp": 1, "cp": 1})


def test_fix_fully_specifying_a_layout_evaluates_just_that_layout():
    fix = parse_fix(["parallel.dp=2,parallel.tp=2,parallel.pp=2,parallel.cp=1,parallel.zero=1",
                     "parallel.micro_batch=2,parallel.schedule=1f1b,parallel.recompute=selective"])
    res = search(TINY, TrainSpec(global_batch=16), Cluster(1, 8, DEV), fix=fix)
    assert len(res.candidates) == 1 and res.configurations_evaluated == 1
    # sequence parallelism is not fixed: the search's recommendation with tp > 1 (on) is taken
    assert res.candidates[0].layout == Layout(dp=2, tp=2, pp=2, zero=1, micro_batch=2, recompute="selective",
                                              sequence_parallel=True)


def test_parse_fix_reads_interleaved_chunks_and_rejects_unknown_keys():
    assert parse_fix(["parallel.schedule=interleaved-v4"]) == {"schedule": "interleaved_1f1b", "virtual_stages": 4}
    with pytest.raises(ConfigError, match="expected parallel.KEY=VALUE"):
        parse_fix(["parallel.tpp=2"])
    with pytest.raises(ConfigError, match="integer"):
        parse_fix(["parallel.tp=two"])
    with pytest.raises(ConfigError, match="ZeRO stage 0, 1, 2 or 3"):
        parse_fix(["parallel.zero=5"])
    with pytest.raises(ConfigError, match="positive integer"):
        parse_fix(["parallel.micro_batch=0"])
    with pytest.raises(ConfigError, match="expected 1f1b, gpipe, interleaved-vN, zero_bubble or zbv"):
        parse_fix(["parallel.schedule=zb"])


def _faster_net(dev, factor):
    return dataclasses.replace(dev, inter_node_bandwidth=dev.inter_node_bandwidth * factor,
                               intra_node_bandwidth=dev.intra_node_bandwidth * factor)


def test_more_bandwidth_never_makes_a_predicted_step_slower():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=64)
    res = search(m, train, Cluster(2, 8, DEV), fix={"micro_batch": 1})
    for p in res.candidates[::7]:
        slower = p.step_time_s
        for factor in (2, 4, 100):
            q = evaluate(m, p.layout, train, Cluster(2, 8, _faster_net(DEV, factor)))
            assert q.step_time_s <= slower + 1e-12
            slower = q.step_time_s
    best_slow = res.candidates[0].step_time_s
    best_fast = search(m, train, Cluster(2, 8, _faster_net(DEV, 4)), fix={"micro_batch": 1}).candidates[0]
    assert best_fast.step_time_s <= best_slow


def test_inter_node_bandwidth_moves_the_choice_towards_less_cross_node_traffic():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=64)
    slow_net = dataclasses.replace(DEV, inter_node_bandwidth=1e9)
    fast = search(m, train, Cluster(4, 8, DEV), fix={"micro_batch": 1, "recompute": "selective"}).candidates[0]
    slow = search(m, train, Cluster(4, 8, slow_net), fix={"micro_batch": 1, "recompute": "selective"}).candidates[0]
    assert slow.step_time_s > fast.step_time_s
    dp_bytes = lambda p: sum(i.bytes for i in p.comm if not i.intra_node)  # noqa: E731
    assert dp_bytes(slow) <= dp_bytes(fast)


def test_more_devices_never_lower_predicted_throughput_for_a_data_parallel_friendly_model():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=128)
    t8 = search(m, train, Cluster(1, 8, DEV), fix={"micro_batch": 1}).candidates[0].tokens_per_s
    t16 = search(m, train, Cluster(2, 8, DEV), fix={"micro_batch": 1}).candidates[0].tokens_per_s
    assert t16 > 1.5 * t8


def test_prediction_json_has_exactly_the_documented_keys():
    res = search(TINY, TrainSpec(global_batch=16), Cluster(1, 8, DEV))
    assert list(res.candidates[0].to_json()) == [
        "dp", "tp", "pp", "ep", "cp", "zero", "micro_batch", "schedule", "recompute",
        "memory_per_device_bytes", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"]


def test_published_runs_table_predicts_every_run_it_has_a_profile_for():
    from chipset.planner.published import RUNS, predict

    profiles = {"a100-80g": ("t", dataclasses.replace(DEV, total_memory=80 * 2**30, peak_flops={"bfloat16": 312e12}))}
    run = next(r for r in RUNS if r.label == "GPT 145.6B")
    p = predict(run, profiles)
    assert p is not None and p.fits
    assert (p.layout.tp, p.layout.pp, p.layout.dp, p.layout.recompute) == (8, 8, 24, "full")
    assert 0.5 < p.tflops_per_device / run.tflops < 2  # same order of magnitude as the published 148
    assert predict(run, {}) is None


def test_evaluate_rejects_an_impossible_layout_with_a_config_error():
    with pytest.raises(ConfigError, match=r"ep \(4\) must divide dp\*cp \(2\)"):
        evaluate(PRESETS["mixtral-8x7b"], Layout(dp=2, ep=4), TrainSpec(global_batch=8), Cluster(1, 8, DEV))
    with pytest.raises(ConfigError, match="recompute must be one of"):
        evaluate(TINY, Layout(recompute="some"), TrainSpec(global_batch=8), Cluster(1, 8, DEV))
