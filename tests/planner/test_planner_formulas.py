"""Cost-model formulas against their published forms: FLOPs, ZeRO memory, activations, volumes, bubble."""

from __future__ import annotations

import dataclasses
import math

import pytest

from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.comm import (
    bytes_by_collective,
    communication,
    is_intra_node,
    latency_steps,
    ring_bytes,
)
from chipset.planner.flops import (
    forward_flops_per_token,
    matmul_params,
    model_flops_per_token,
    narayanan_flops,
    step_flops,
)
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import (
    block_activation_bytes,
    in_flight_chunks,
    memory_per_device,
    zero_model_state_bytes,
)
from chipset.planner.model import PRESETS
from chipset.planner.time import bubble_fraction, evaluate

GPT3 = PRESETS["gpt3-175b"]
DEV = DeviceProperties(name="test", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 300e12},
                       memory_bandwidth=2e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)


def test_flops_reproduce_narayanan_equation_3_exactly_for_gpt3():
    B, s, L, h, V = 1536, GPT3.seq_len, GPT3.layers, GPT3.hidden, GPT3.vocab
    # Eq. (3) expanded into integers: 96Bslh^2 (1 + s/6h + V/16lh)
    assert step_flops(GPT3, B, "full") == 96 * B * s * L * h**2 + 16 * B * s**2 * L * h + 6 * B * s * h * V
    assert step_flops(GPT3, B, "none") == 72 * B * s * L * h**2 + 12 * B * s**2 * L * h + 6 * B * s * h * V
    assert math.isclose(step_flops(GPT3, B, "full"), narayanan_flops(B, s, L, h, V, True), rel_tol=1e-12)
    assert math.isclose(step_flops(GPT3, B, "none"), narayanan_flops(B, s, L, h, V, False), rel_tol=1e-12)


def test_selective_recompute_adds_only_the_attention_core_forward():
    B = 8
    extra = step_flops(GPT3, B, "selective") - step_flops(GPT3, B, "none")
    assert extra == 4 * B * GPT3.seq_len**2 * GPT3.hidden * GPT3.layers


def test_palm_model_flops_equal_three_forward_passes():
    for m in PRESETS.values():
        assert model_flops_per_token(m) == 3 * forward_flops_per_token(m).total
    m = PRESETS["llama2-7b"]  # N excludes the input-embedding lookup, includes the logit matrix
    assert matmul_params(m) == m.num_params() - m.vocab * m.hidden - (2 * m.layers + 1) * m.hidden


@pytest.mark.parametrize("n", [1, 4, 64])
def test_zero_stages_match_the_design_formulas(n):
    psi = 1_000_000
    total = [sum(zero_model_state_bytes(psi, n, z)) for z in range(4)]
    assert total[0] == 16 * psi
    assert math.isclose(total[1], 4 * psi + 12 * psi / n)
    assert math.isclose(total[2], 2 * psi + 14 * psi / n)
    assert math.isclose(total[3], 16 * psi / n)


def _gpt(**kw):
    return dataclasses.replace(GPT3, **kw)


def test_activations_reproduce_korthikanti_section_4():
    m = _gpt()  # dropout, no flash attention, GeLU f=4h, MHA: the paper's setting
    s, b, h, a, t = m.seq_len, 2, m.hidden, m.heads, 8
    sbh = s * b * h
    L = lambda **kw: Layout(micro_batch=b, **{"sequence_parallel": True, **kw})  # noqa: E731  (the paper's Sec. 4.2.2)
    assert block_activation_bytes(m, L(), s) == sbh * (34 + 5 * a * s / h)
    assert math.isclose(block_activation_bytes(m, L(tp=t, sequence_parallel=False), s),
                        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert math.isclose(block_activation_bytes(m, L(tp=t), s), sbh / t * (34 + 5 * a * s / h))
    assert math.isclose(block_activation_bytes(m, L(tp=t, recompute="selective"), s), 34 * sbh / t)
    assert math.isclose(block_activation_bytes(m, L(tp=t, recompute="full"), s), 2 * sbh / t)
    # context parallelism divides the sequence (the s^2 term by cp as well: local queries x all keys)
    assert math.isclose(block_activation_bytes(m, L(tp=t, cp=4, recompute="selective"), s), 34 * sbh / t / 4)


def test_flash_attention_drops_the_quadratic_term_and_gqa_shrinks_kv():
    m = PRESETS["llama2-70b"]
    lay = Layout(micro_batch=1)
    short = block_activation_bytes(m, lay, 1024)
    long = block_activation_bytes(m, lay, 4096)
    assert math.isclose(long / short, 4.0, rel_tol=1e-6)  # linear in s
    mha = block_activation_bytes(dataclasses.replace(m, kv_heads=0), lay, 1024)
    assert mha - short == 4 * 1024 * m.hidden * (1 - m.kv / m.heads) * 1


@pytest.mark.parametrize(("schedule", "v", "m", "expect"), [
    ("1f1b", 1, 32, 8), ("1f1b", 1, 4, 4), ("gpipe", 1, 32, 32), ("interleaved_1f1b", 2, 32, 2 * 7 + 8 + 1),
])
def test_in_flight_micro_batches_by_schedule(schedule, v, m, expect):
    assert in_flight_chunks(Layout(pp=8, schedule=schedule, virtual_stages=v), m) == expect


def test_interleaving_reduces_activation_memory_towards_korthikanti_bound():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=64)
    plain = memory_per_device(m, Layout(pp=4, schedule="1f1b"), train).activations
    inter = memory_per_device(m, Layout(pp=4, schedule="interleaved_1f1b", virtual_stages=4), train).activations
    # 1F1B holds l blocks' worth on stage 0; interleaved l (1 + (p-1)/(p v)) = 1.1875 l
    assert 1.1 < inter / plain < 1.3


def test_ring_volumes_and_latency_steps():
    assert ring_bytes("all_reduce", 800, 8) == 2 * 7 / 8 * 800
    assert ring_bytes("reduce_scatter", 800, 8) == ring_bytes("all_gather", 800, 8) == 700
    assert ring_bytes("all_to_all", 800, 4) == 600
    assert ring_bytes("all_reduce", 800, 1) == 0
    assert (latency_steps("all_reduce", 8), latency_steps("all_gather", 8), latency_steps("send", 2)) == (14, 7, 1)


def test_bubble_fractions():
    assert bubble_fraction(8, 64) == 7 / 64
    assert bubble_fraction(8, 64, v=4) == 7 / 256
    assert bubble_fraction(1, 3) == 0


def test_group_placement_follows_the_rank_order():
    assert is_intra_node(8, 1, 8) and not is_intra_node(16, 1, 8)
    assert is_intra_node(2, 4, 8) and not is_intra_node(4, 4, 8)
    assert not is_intra_node(4, 1, 6)  # 6-device nodes: some tp=4 groups straddle two nodes


def _items(m, lay, train, nodes=2, per_node=8):
    return communication(m, lay, train, Cluster(nodes, per_node, DEV))


def test_dp_volume_per_zero_stage():
    m = PRESETS["llama2-7b"]
    psi = m.num_params()
    train = TrainSpec(global_batch=64)
    n = 16
    by = {z: _items(m, Layout(dp=n, zero=z, micro_batch=1), train) for z in range(4)}
    vol = {z: sum(i.bytes for i in by[z] if i.dim == "dp") for z in range(4)}
    mb = 64 // 16
    assert math.isclose(vol[0], 2 * (n - 1) / n * 2 * psi)
    assert math.isclose(vol[1], vol[0])  # reduce-scatter + all-gather = all-reduce
    assert math.isclose(vol[2], (n - 1) / n * 2 * psi * (mb + 1))  # reduce-scatter every micro-batch
    assert math.isclose(vol[3], 3 * mb * (n - 1) / n * 2 * psi)  # 1.5x per micro-batch
    assert all(not i.intra_node for i in by[0])  # 16 ranks on 8-device nodes


def test_tp_and_sp_volumes_and_pp_sends():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=8)
    s, h, t, p = m.seq_len, m.hidden, 8, 2
    lay = Layout(dp=1, tp=t, pp=p, micro_batch=1, sequence_parallel=False)
    items = _items(m, lay, train)
    tp = [i for i in items if i.dim == "tp"]
    assert [i.op for i in tp] == ["all_reduce"]
    calls = (m.layers // p * 4 + 1) * 8
    assert tp[0].calls == calls and tp[0].intra_node
    assert math.isclose(tp[0].bytes, calls * 2 * (t - 1) / t * 2 * s * h)
    sp = [i for i in _items(m, dataclasses.replace(lay, sequence_parallel=True), train) if i.dim == "tp"]
    assert sorted(i.op for i in sp) == ["all_gather", "reduce_scatter"]
    assert math.isclose(sum(i.bytes for i in sp), tp[0].bytes)
    pp = [i for i in items if i.dim == "pp"]
    assert pp[0].op == "send" and pp[0].calls == 2 * 8 and math.isclose(pp[0].bytes, 16 * 2 * s * h / t)
    assert not pp[0].intra_node


def test_ep_all_to_all_volume():
    m = PRESETS["mixtral-8x7b"]
    lay = Layout(dp=8, ep=8, micro_batch=1)
    ep = [i for i in _items(m, lay, TrainSpec(global_batch=8), nodes=1) if i.dim == "ep"]
    assert ep[0].op == "all_to_all" and ep[0].calls == 4 * m.layers
    assert math.isclose(ep[0].bytes, 4 * m.layers * 7 / 8 * 2 * m.seq_len * m.hidden * m.top_k)


def test_dp_overlap_hides_communication_and_never_costs_time():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=64)
    cl = Cluster(2, 8, DEV)
    from chipset.planner.assumptions import Assumptions

    lay = Layout(dp=16, zero=1, micro_batch=1, recompute="full")
    on = evaluate(m, lay, train, cl, Assumptions(dp_overlap=True))
    off = evaluate(m, lay, train, cl, Assumptions(dp_overlap=False))
    assert on.step_time_s < off.step_time_s
    assert math.isclose(off.step_time_s - on.step_time_s, off.breakdown["dp_exposed"] - on.breakdown["dp_exposed"])


def test_bytes_by_collective_sums_per_dimension_and_op():
    m = PRESETS["llama2-7b"]
    items = _items(m, Layout(dp=2, tp=4, zero=3, micro_batch=1, sequence_parallel=True), TrainSpec(global_batch=4))
    by = bytes_by_collective(items)
    assert set(by) == {("dp", "all_gather"), ("dp", "reduce_scatter"), ("tp", "all_gather"), ("tp", "reduce_scatter")}
    assert math.isclose(by[("dp", "all_gather")], 2 * by[("dp", "reduce_scatter")])  # forward + backward gathers
    assert math.isclose(sum(by.values()), sum(i.bytes for i in items))


def test_single_device_model_states_hold_every_parameter_once():
    for name in ("llama2-7b", "mixtral-8x7b", "gpt3-175b"):
        m = PRESETS[name]
        mem = memory_per_device(m, Layout(), TrainSpec(global_batch=1))
        assert mem.params == 2 * m.num_params() and mem.grads == 2 * m.num_params()
        assert mem.optimizer == 12 * m.num_params()


def test_tp_and_ep_shard_the_matrices_they_split():
    m = PRESETS["mixtral-8x7b"]
    train = TrainSpec(global_batch=8)
    one = memory_per_device(m, Layout(dp=8), train).params
    ep8 = memory_per_device(m, Layout(dp=8, ep=8), train).params
    assert math.isclose(one - ep8, 2 * m.expert_params() * 7 / 8)
    tp8 = memory_per_device(PRESETS["llama2-7b"], Layout(tp=8), train).params
    norms = (2 * 32 + 1) * 4096
    assert math.isclose(tp8, 2 * ((PRESETS["llama2-7b"].num_params() - norms) / 8 + norms))


def test_predicted_bubble_is_the_schedule_fraction_of_the_ideal_pipeline_time():
    m = PRESETS["llama2-7b"]
    cl = Cluster(1, 8, DEV)
    train = TrainSpec(global_batch=32)
    for lay in (Layout(pp=8, schedule="1f1b"), Layout(pp=8, schedule="interleaved_1f1b", virtual_stages=4),
                Layout(pp=4, dp=2, schedule="gpipe")):
        p = evaluate(m, lay, train, cl)
        slot = (p.breakdown["compute"] + p.breakdown["tp"] + p.breakdown["pp"] + p.breakdown["ep"]
                + p.breakdown["cp_exposed"])
        assert math.isclose(p.breakdown["bubble"], slot * bubble_fraction(lay.pp, p.micro_batches, lay.v))


def test_a_tiny_model_is_never_faster_than_its_kernels_can_be_launched():
    """Issue 20: a 3M-parameter model's roofline is microseconds; the step must still pay one launch
    latency per kernel of every micro-batch and the profile's host overhead."""
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.model import ModelSpec
    from chipset.planner.time import launch_floor

    a = Assumptions()
    m = ModelSpec(layers=4, hidden=256, heads=4, ffn_hidden=512, vocab=4096, seq_len=128)
    lay = Layout(micro_batch=2)
    p = evaluate(m, lay, TrainSpec(global_batch=8), Cluster(1, 1, DEV))
    kernels = launch_floor(4, "none", a) * p.micro_batches
    assert kernels == 4 * 3 * a.kernels_per_block_forward * 4  # 4 micro-batches of 4 blocks
    assert p.breakdown["roofline"] < p.breakdown["launch_floor"]  # really launch-bound
    assert p.breakdown["compute"] == pytest.approx(kernels * a.kernel_launch_latency)
    floor = kernels * a.kernel_launch_latency + a.kernels_per_step * a.kernel_launch_latency
    assert p.step_time_s >= floor + a.step_host_overhead
    # a profile's own latency and host overhead replace the defaults
    slow = dataclasses.replace(DEV, kernel_launch_latency=20e-6, step_host_overhead=5e-3)
    q = evaluate(m, lay, TrainSpec(global_batch=8), Cluster(1, 1, slow))
    assert q.breakdown["compute"] == pytest.approx(kernels * 20e-6) and q.breakdown["host"] == 5e-3


def test_the_launch_floor_does_not_touch_a_large_model():
    m = PRESETS["llama2-7b"]
    p = evaluate(m, Layout(dp=8, zero=1, micro_batch=1), TrainSpec(global_batch=64), Cluster(1, 8, DEV))
    assert p.breakdown["launch_floor"] < 0.05 * p.breakdown["roofline"]
    assert p.breakdown["compute"] == pytest.approx(p.breakdown["roofline"])


def test_the_optimizer_update_moves_its_bytes_at_the_achievable_memory_bandwidth():
    """A fused update moves 2(P + G + K) bytes per local parameter, an unfused one
    ``update_bytes``; both at memory_efficiency of the bandwidth, as the other streaming kernels."""
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.time import optimizer_time

    a = Assumptions()
    params, bw = 1e9, DEV.memory_bandwidth
    fused = optimizer_time(TrainSpec(), params, bw, a)
    assert fused == pytest.approx(2 * (2 + 2 + 12) * params / (bw * a.memory_efficiency), rel=1e-12)
    assert optimizer_time(TrainSpec(update_bytes=92), params, bw, a) == pytest.approx(fused * 92 / 32, rel=1e-12)
    assert optimizer_time(TrainSpec(), params, 0.0, a) == 0.0
    # evaluate() charges it on the local shard (ZeRO-1 over 2 replicas updates half the parameters),
    # never below the launch floor of the step's kernels.
    m = dataclasses.replace(GPT3, layers=4, hidden=1024, heads=8, ffn_hidden=4096)
    cl = Cluster(1, 2, DEV)
    lay = Layout(dp=2, zero=1, micro_batch=1)
    slow = evaluate(m, lay, TrainSpec(global_batch=2, update_bytes=320), cl)
    fast = evaluate(m, lay, TrainSpec(global_batch=2), cl)
    assert fast.breakdown["optimizer"] > a.kernels_per_step * a.kernel_launch_latency
    assert slow.breakdown["optimizer"] == pytest.approx(10 * fast.breakdown["optimizer"], rel=1e-9)
    assert slow.step_time_s - fast.step_time_s == pytest.approx(9 * fast.breakdown["optimizer"], rel=1e-9)
