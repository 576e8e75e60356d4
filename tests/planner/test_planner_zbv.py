"""The planner's ZBV: positions, in-flight chunks read off chipset's schedule, bubble, --fix.

Its peak memory against cpu_sim's measurement is in test_planner_validation_memory.py ("pp2 zbv",
"dp2 x pp2 zero3 zbv, 4 micro-batches").
"""

from __future__ import annotations

import dataclasses

import pytest

from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import in_flight_chunks, memory_per_stage, params_per_device
from chipset.planner.model import PRESETS
from chipset.planner.search import parse_fix, search
from chipset.planner.time import evaluate
from chipset.runtime.pipeline.check import check_schedule
from chipset.runtime.pipeline.schedules import Op, zbv, zero_bubble

DEV = DeviceProperties(name="test", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 300e12},
                       memory_bandwidth=2e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)
LLAMA = PRESETS["llama2-7b"]  # 32 blocks


def _most_in_flight(p: int, m: int, rank: int) -> int:
    """The most chunk micro-batches rank ``rank`` holds between a forward and its weight half."""
    alive, most = set(), 0
    for ins in zbv(p, m).ranks[rank]:
        if ins.op == Op.FORWARD:
            alive.add((ins.chunk, ins.mb))
            most = max(most, len(alive))
        elif ins.op in (Op.BACKWARD_WEIGHT, Op.BACKWARD):
            alive.discard((ins.chunk, ins.mb))
    return most


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
def test_in_flight_chunks_formula_is_the_schedules_count(p, m):
    lay = Layout(pp=p, schedule="zbv", virtual_stages=2)
    for rank in range(p):
        assert in_flight_chunks(lay, m, rank) == _most_in_flight(p, m, rank), rank
        # never more than 1F1B's first rank: p micro-batches of two chunks each
        assert in_flight_chunks(lay, m, rank) <= 2 * min(p, m)


def test_rank_0_holds_the_embedding_and_the_head_and_the_turn_neither():
    lay = Layout(pp=4, schedule="zbv", virtual_stages=2)
    stages, _ = params_per_device(LLAMA, lay)
    assert set(stages) == {"ends", "turn"}
    edges = LLAMA.vocab * LLAMA.hidden * 2 + LLAMA.norm_params()  # untied embedding and head, final norm
    assert stages["ends"] - stages["turn"] == pytest.approx(edges)
    one_f = params_per_device(LLAMA, dataclasses.replace(lay, schedule="1f1b", virtual_stages=1))[0]
    assert stages["turn"] == pytest.approx(one_f["first"] - LLAMA.vocab * LLAMA.hidden)  # the same 8 blocks
    mem = memory_per_stage(LLAMA, lay, TrainSpec(global_batch=64), 4096)
    assert mem["ends"].total > mem["turn"].total


def test_bubble_is_the_schedules_own_idle_time():
    """The bubble in slots is what chipset's schedule idles, as the checker times it. ZBV: (p-1)/6 of
    a slot from m = (3p-1)/2 on, more below (rank 0 waits for its micro-batches to come back round
    the V). Zero bubble: ZB-H1's (p-1)/3 from m = p on, more below."""
    cl = Cluster(1, 4, DEV)
    for m, zbv_slots, zb_slots in ((2, 10 / 6, 5 / 3), (4, 6 / 6, 1), (6, 3 / 6, 1), (8, 3 / 6, 1)):
        train = TrainSpec(global_batch=m)
        v = evaluate(LLAMA, Layout(pp=4, schedule="zbv", virtual_stages=2, recompute="full"), train, cl, seq_len=4096)
        zb = evaluate(LLAMA, Layout(pp=4, schedule="zero_bubble", recompute="full"), train, cl, seq_len=4096)
        assert v.bubble_slots == pytest.approx(zbv_slots) == pytest.approx(check_schedule(zbv(4, m)).bubble * m)
        assert zb.bubble_slots == pytest.approx(zb_slots) == pytest.approx(check_schedule(zero_bubble(4, m)).bubble * m)


def test_fix_plans_zbv_and_the_search_never_proposes_it():
    assert parse_fix(["parallel.schedule=zbv"]) == {"schedule": "zbv", "virtual_stages": 2}
    train, cl = TrainSpec(global_batch=64), Cluster(1, 8, DEV)
    res = search(LLAMA, train, cl, fix=parse_fix(["parallel.pp=4,parallel.schedule=zbv"]))
    assert res.candidates and all(c.layout.schedule == "zbv" and c.layout.v == 2 for c in res.candidates)
    assert all(c.layout.schedule != "zbv" for c in search(LLAMA, train, cl).candidates)


def test_zbv_needs_two_chunks_and_blocks_that_2pp_divides():
    with pytest.raises(ConfigError, match="virtual_stages = 2"):
        Layout(pp=2, schedule="zbv", virtual_stages=3).check()
    odd = dataclasses.replace(LLAMA, layers=30)  # 30 blocks over 2 x 4 virtual stages
    with pytest.raises(ConfigError, match="2 x pp divides the blocks"):
        memory_per_stage(odd, Layout(pp=4, schedule="zbv", virtual_stages=2), TrainSpec(global_batch=64), 4096)
    with pytest.raises(ConfigError, match="zbv planned only when 2 x pp divides the blocks"):
        search(odd, TrainSpec(global_batch=64), Cluster(1, 8, DEV), fix={"pp": 4, "schedule": "zbv"})


def test_projection_charges_each_schedules_own_bubble():
    """chipset train --project: with the same counted bytes and compute, zero_bubble's bubble is a
    third of 1F1B's and ZBV's (m = 4p) a sixth (it charged 1F1B's (p-1)/v slots to both before)."""
    from chipset.planner.projection import project
    from chipset.train.config import RunConfig

    model = {"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 688}
    comm = {"batch_p2p": {"calls": [16, 16], "bytes": [2**20, 2**20]}}
    bubble = {}
    for sched, v in (("1f1b", 1), ("zero_bubble", 1), ("zbv", 2)):
        cfg = RunConfig.from_dict({"model": model, "train": {"global_batch": 16, "seq_len": 128},
                                   "parallel": {"pp": 2, "micro_batches": 8, "schedule": sched,
                                                "virtual_stages": v}}).validate(world_size=2)
        bubble[sched] = project(cfg, 2, comm, "h100-sxm")["bubble_s"]
    assert bubble["zero_bubble"] == pytest.approx(bubble["1f1b"] / 3)
    assert bubble["zbv"] == pytest.approx(bubble["1f1b"] / 6)
