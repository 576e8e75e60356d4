"""Pipeline parallelism: schedules as data, checked before they run, and equal to one process.

Unit tests cover the schedule generators and the checker (including broken schedules it
must reject). The parity tests start two torchrun jobs (2 and 4 ranks, gloo on the
default backend) that run every pipeline variant in turn, plus one single-process job for
the reference (tests/multirank.py); this file is also the jobs' script (``__main__`` below).

Tolerances: derived in tests/parity.py, so they hold on any CPU: per-step losses and
gradient norms within the fp32 reduction-order bound, parameters within AdamW's worst
case (the stages' norm partial sums are added in another order, so the clip coefficient
differs in the last bit, and AdamW turns the rounding of an element whose gradient is ~0
into an update of up to lr). tests/runtime/test_engine_parity.py shows the same checks reject a
wrong gradient reduction. 10 steps, as issue 5 asks.
"""

from __future__ import annotations

import gc
import io
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import multirank
import parity
from chipset.errors import ConfigError
from chipset.runtime.pipeline import (
    Instruction,
    Op,
    PipelineSchedule,
    ScheduleError,
    check_schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    parse_split,
    render,
    split_units,
    zbv,
    zero_bubble,
)
from multirank import merge as _merge

HERE = Path(__file__).resolve()
STEPS = 10
M = 4
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 7},
    "parallel": {"bucket_mb": 0.02, "micro_batches": M},
}
VARIANTS = {
    2: {
        "pp2_gpipe": {"parallel": {"pp": 2, "schedule": "gpipe"}},
        "pp2_1f1b": {"parallel": {"pp": 2, "schedule": "1f1b"}},
        "pp2_interleaved": {"parallel": {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}},
        "pp2_1f1b_split": {"parallel": {"pp": 2, "schedule": "1f1b", "pipeline_split": "1,5"},
                           "train": {"recompute": "full"}},
        "pp2_zero_bubble": {"parallel": {"pp": 2, "schedule": "zero_bubble"}},
        "pp2_zbv": {"parallel": {"pp": 2, "schedule": "zbv", "virtual_stages": 2}},
    },
    4: {
        "pp4_interleaved": {"parallel": {"pp": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}},
        "dp2_pp2": {"parallel": {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b"}},
        "tp2_pp2": {"parallel": {"pp": 2, "tp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}},
        "dp2_pp2_zero_bubble_zero3": {"parallel": {"pp": 2, "dp": 2, "zero": 3, "schedule": "zero_bubble"}},
        "dp2_pp2_zbv_zero3": {"parallel": {"pp": 2, "dp": 2, "zero": 3, "schedule": "zbv", "virtual_stages": 2}},
    },
}


# --------------------------------------------------------------------------------------
# Unit tests: generators and checker (no processes)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gpipe_and_1f1b_pass_the_checker_with_the_theoretical_bubble(p, m):
    for sched in (gpipe(p, m), one_f_one_b(p, m)):
        sim = check_schedule(sched)
        assert sim.bubble == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4), (8, 8, 2)])
def test_interleaved_passes_the_checker_with_bubble_over_v(p, m, v):
    sched = interleaved_1f1b(p, m, v)
    assert check_schedule(sched).bubble == pytest.approx((p - 1) / (v * m))


def test_1f1b_keeps_at_most_p_minus_r_micro_batches_in_flight():
    p, m = 4, 8
    for sched, bound in ((one_f_one_b(p, m), lambda r: p - r), (gpipe(p, m), lambda r: m)):
        for r, instrs in enumerate(sched.ranks):
            live = peak = 0
            for ins in instrs:
                live += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(ins.op, 0)
                peak = max(peak, live)
            assert peak == bound(r), (sched.name, r, peak)


def test_every_rank_runs_each_forward_and_backward_once():
    s = interleaved_1f1b(4, 8, 2)
    for instrs in s.ranks:
        f = sorted((i.chunk, i.mb) for i in instrs if i.op is Op.FORWARD)
        b = sorted((i.chunk, i.mb) for i in instrs if i.op is Op.BACKWARD)
        assert f == b == [(c, mb) for c in range(2) for mb in range(8)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zero_bubble_idles_zb_h1s_p_minus_1_units_at_every_m(p):
    """Timed as the runtime runs it (each send waited at the next batch, receives posted a compute op
    ahead). From m = p on every rank idles ZB-H1's p-1 units (F = B = W = 1); with fewer micro-batches
    2p-1-m. The list-scheduled order before idled 3-5 units at p = 4 and 7-11 at p = 8, and 2 units
    at p = 2 with an odd m."""
    for m in range(1, 3 * p + 2):
        s = zero_bubble(p, m)
        zb, one = check_schedule(s), check_schedule(one_f_one_b(p, m))
        assert zb.makespan - 3 * m == max(p - 1, 2 * p - 1 - m), m
        assert zb.bubble == pytest.approx(s.theoretical_bubble()), m
        if m > 1:
            assert zb.makespan < one.makespan, m


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zbv_theory_is_its_simulated_bubble_at_every_m(p):
    for m in range(1, 3 * p + 1):
        s = zbv(p, m)
        assert check_schedule(s).bubble == pytest.approx(s.theoretical_bubble()), m


@pytest.mark.parametrize("p,m", [(2, 4), (3, 2), (4, 8), (8, 16)])
def test_zero_bubble_runs_each_half_once_and_holds_at_most_p_micro_batches(p, m):
    for r, instrs in enumerate(zero_bubble(p, m).ranks):
        order = {op: [i.mb for i in instrs if i.op is op]
                 for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.BACKWARD)}
        assert order[Op.BACKWARD] == []
        for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            assert sorted(order[op]) == list(range(m)), op
        live = peak = 0
        for ins in instrs:
            live += {Op.FORWARD: 1, Op.BACKWARD_WEIGHT: -1}.get(ins.op, 0)
            peak = max(peak, live)
        assert peak <= p
        waiting = most = 0  # forwards whose input half has not run: 1F1B's p-r
        for ins in instrs:
            waiting += {Op.FORWARD: 1, Op.BACKWARD_INPUT: -1}.get(ins.op, 0)
            most = max(most, waiting)
        assert most == min(p - r, m)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_zbv_places_chunks_in_a_v_and_beats_zero_bubble(p, m):
    s = zbv(p, m)
    assert [s.locate(vs) for vs in range(2 * p)] == [(r, 0) for r in range(p)] + [(r, 1) for r in reversed(range(p))]
    assert s.local_neighbour(p - 1, 0, +1) == 1 and s.local_neighbour(p - 1, 1, -1) == 0
    assert s.local_neighbour(0, 0, +1) is None
    sim, zb = check_schedule(s), check_schedule(zero_bubble(p, m))
    assert sim.bubble <= zb.bubble + 1e-12  # a chunk is half a stage: compare idle shares, not makespans
    if m >= 2 * p:
        assert sim.bubble < zb.bubble
        assert sim.bubble == pytest.approx(s.theoretical_bubble()) == pytest.approx((p - 1) / (6 * m))
    for r, instrs in enumerate(s.ranks):
        assert all(i.peer != r for i in instrs if not i.op.is_compute)  # the turn needs no transfer
        live = peak = 0
        for ins in instrs:
            live += {Op.FORWARD: 1, Op.BACKWARD_WEIGHT: -1}.get(ins.op, 0)
            peak = max(peak, live)
        assert peak <= 2 * p  # chunk micro-batches: 1F1B's first-rank activation memory
        for c in (0, 1):
            for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                assert sorted(i.mb for i in instrs if i.op is op and i.chunk == c) == list(range(m))


def test_zbv_receives_in_the_senders_order_and_needs_its_buffered_sends():
    s = zbv(2, 4)
    # Rank 0 sends rank 1 activations (virtual stage 0 -> 1) and gradients (3 -> 2) on one pair:
    # rank 1 receives them in rank 0's order, some ahead of the compute that uses them.
    sent = [(i.op, i.mb) for i in s.ranks[0] if i.op.is_send and i.peer == 1]
    got = [({Op.RECV_ACT: Op.SEND_ACT, Op.RECV_GRAD: Op.SEND_GRAD}[i.op], i.mb)
           for i in s.ranks[1] if i.op in (Op.RECV_ACT, Op.RECV_GRAD) and i.peer == 0]
    assert got == sent and {op for op, _ in sent} == {Op.SEND_ACT, Op.SEND_GRAD}
    # Waiting each send one batch later, as the other schedules do, would deadlock it.
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(replace(s, buffered_sends=False))
    # A send nobody receives is caught even though no batch waits for it.
    with pytest.raises(ScheduleError, match="rank 1 never receives this send"):
        check_schedule(_edit(s, 0, [*s.ranks[0], Instruction(Op.SEND_ACT, 3, 0, 1)]))


def test_checker_rejects_a_local_hand_off_done_out_of_order_or_as_a_transfer():
    s = zbv(2, 2)
    r1 = list(s.ranks[1])
    f0, f1 = r1.index(Instruction(Op.FORWARD, 0, 0)), r1.index(Instruction(Op.FORWARD, 0, 1))
    r1[f0], r1[f1] = r1[f1], r1[f0]
    with pytest.raises(ScheduleError, match="forward before the forward of chunk 0"):
        check_schedule(_edit(s, 1, r1))
    r1 = list(s.ranks[1])
    b1, b0 = r1.index(Instruction(Op.BACKWARD_INPUT, 0, 1)), r1.index(Instruction(Op.BACKWARD_INPUT, 0, 0))
    r1[b1], r1[b0] = r1[b0], r1[b1]
    with pytest.raises(ScheduleError, match="backward before the backward of chunk 1"):
        check_schedule(_edit(s, 1, r1))
    r1 = list(s.ranks[1])
    r1.insert(r1.index(Instruction(Op.FORWARD, 0, 1)), Instruction(Op.RECV_ACT, 0, 1, 1))
    with pytest.raises(ScheduleError, match="hand off locally"):
        check_schedule(_edit(s, 1, r1))


def test_checker_rejects_a_weight_half_before_its_input_half_and_mixed_backwards():
    s = zero_bubble(2, 2)
    r0 = list(s.ranks[0])
    w = r0.index(Instruction(Op.BACKWARD_WEIGHT, 0))
    r0.insert(0, r0.pop(w))
    with pytest.raises(ScheduleError, match="weight gradient before its input gradient"):
        check_schedule(_edit(s, 0, r0))
    r1 = [replace(i, op=Op.BACKWARD) if i == Instruction(Op.BACKWARD_INPUT, 1) else i for i in s.ranks[1]]
    with pytest.raises(ScheduleError, match="either all whole or all split"):
        check_schedule(_edit(s, 1, r1))
    r1 = [i for i in s.ranks[1] if i != Instruction(Op.BACKWARD_WEIGHT, 1)]
    with pytest.raises(ScheduleError, match="never runs the weight gradient of chunk 0, micro-batch 1"):
        check_schedule(_edit(s, 1, r1))


def _edit(s: PipelineSchedule, rank: int, instrs: list[Instruction]) -> PipelineSchedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(instrs)
    return replace(s, ranks=tuple(ranks))


def test_checker_rejects_a_deadlocking_schedule_naming_rank_and_instruction():
    # A pure ordering deadlock: both ranks receive before they send.
    r0 = [Instruction(Op.FORWARD, 0), Instruction(Op.RECV_GRAD, 0, 0, 1), Instruction(Op.BACKWARD, 0),
          Instruction(Op.SEND_ACT, 0, 0, 1)]
    r1 = [Instruction(Op.RECV_ACT, 0, 0, 0), Instruction(Op.FORWARD, 0), Instruction(Op.BACKWARD, 0),
          Instruction(Op.SEND_GRAD, 0, 0, 0)]
    with pytest.raises(ScheduleError, match=r"rank 0, instruction 1 \(RECV_GRAD mb 0 <- rank 1\).*deadlock"):
        check_schedule(PipelineSchedule("broken", 2, 1, 1, (tuple(r0), tuple(r1))))


def test_checker_rejects_swapped_transfers_as_a_mismatch():
    s = one_f_one_b(2, 4)
    r1 = list(s.ranks[1])
    a, b = r1.index(Instruction(Op.RECV_ACT, 1, 0, 0)), r1.index(Instruction(Op.RECV_ACT, 2, 0, 0))
    r1[a], r1[b] = r1[b], r1[a]  # rank 1 now expects micro-batch 2 where rank 0 sends 1
    with pytest.raises(ScheduleError) as exc:
        check_schedule(_edit(s, 1, r1))
    msg = str(exc.value)
    assert "rank 1" in msg and "before its input activation" in msg or "micro-batch" in msg


def test_checker_rejects_a_mismatch_the_static_pass_cannot_see():
    # Two sends on one pair in the opposite order from the receives: every instruction is
    # locally plausible, only pairing the n-th send with the n-th receive exposes it.
    r0 = [Instruction(Op.FORWARD, 0), Instruction(Op.FORWARD, 1), Instruction(Op.SEND_ACT, 1, 0, 1),
          Instruction(Op.SEND_ACT, 0, 0, 1), Instruction(Op.RECV_GRAD, 0, 0, 1), Instruction(Op.RECV_GRAD, 1, 0, 1),
          Instruction(Op.BACKWARD, 0), Instruction(Op.BACKWARD, 1)]
    r1 = [Instruction(Op.RECV_ACT, 0, 0, 0), Instruction(Op.RECV_ACT, 1, 0, 0), Instruction(Op.FORWARD, 0),
          Instruction(Op.FORWARD, 1), Instruction(Op.BACKWARD, 0), Instruction(Op.BACKWARD, 1),
          Instruction(Op.SEND_GRAD, 0, 0, 0), Instruction(Op.SEND_GRAD, 1, 0, 0)]
    with pytest.raises(ScheduleError, match=r"pairs rank 0 instruction 2 \(SEND_ACT mb 1 -> rank 1.*micro-batch 0"):
        check_schedule(PipelineSchedule("swapped", 2, 2, 1, (tuple(r0), tuple(r1))))


def test_checker_rejects_missing_work_and_wrong_peers():
    s = gpipe(2, 2)
    with pytest.raises(ScheduleError, match="never runs the backward of chunk 0, micro-batch 1"):
        check_schedule(_edit(s, 0, [i for i in s.ranks[0] if i != Instruction(Op.BACKWARD, 1)]))
    r0 = [replace(i, peer=0) if i.op is Op.SEND_ACT else i for i in s.ranks[0]]
    with pytest.raises(ScheduleError, match="peer must be rank 1"):
        check_schedule(_edit(s, 0, r0))


def test_schedule_options_are_validated():
    with pytest.raises(ConfigError, match="divisible by pipeline ranks"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ConfigError, match="expected one of gpipe, 1f1b, interleaved_1f1b"):
        make_schedule("zb", 2, 4)
    with pytest.raises(ConfigError, match="only interleaved_1f1b"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="set parallel.virtual_stages=2"):
        make_schedule("zbv", 2, 4, 1)


def test_render_prints_a_timeline_and_every_instruction():
    text = render(one_f_one_b(2, 4))
    assert "rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3" in text
    assert "simulated bubble 0.250 (theory 0.250)" in text
    assert "  + RECV_GRAD mb 0 <- rank 1" in text


def test_split_balances_parameters_and_accepts_an_explicit_split():
    from chipset.kernels import KernelRegistry
    from chipset.models.family import TransformerFamily, bind, meta_model
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(BASE)
    model = bind(TransformerFamily(), meta_model(TransformerFamily(), cfg), cfg)  # 6 blocks: chain of 8 units
    specs = split_units(model, 2)
    assert specs[0].names[0] == "embed_tokens" and specs[-1].names[-1] == "head"
    assert [s.last - s.first for s in specs] == [4, 4]
    assert [s.last - s.first for s in split_units(model, 8)] == [1] * 8
    # The transformer's pipeline_split counts blocks; the embedding and head join the end stages.
    assert [s.names for s in split_units(model, 2, "1,5")] == [
        ("embed_tokens", "layers.0"), ("layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "head")]
    assert [s.last - s.first for s in split_units(model, 3, "0,6,0")] == [1, 6, 1]
    # The family states its boundary shapes (MoE routing cannot run on the meta device): they
    # are what the chain computes there with the reference kernels.
    with torch.device("meta"):
        ref = TransformerFamily().build(RunConfig.from_dict(BASE), KernelRegistry("reference"))
    x, shapes = torch.zeros(3, 16, dtype=torch.long, device="meta"), []
    for unit in ref.units():
        x = unit(x)
        shapes.append(x.shape)
    assert TransformerFamily().unit_shapes(RunConfig.from_dict(BASE), torch.zeros(3, 16, dtype=torch.long)) == shapes
    with pytest.raises(ConfigError, match="sums to 5 blocks, expected model.num_hidden_layers = 6"):
        parse_split("1,4", 2, 6)
    with pytest.raises(ConfigError, match="has 3 entries, expected"):
        parse_split("1,4,1", 2, 6)


def test_config_validation_refuses_bad_pipeline_settings_before_launch():
    from chipset.train.config import RunConfig

    def problems(**par):
        cfg = RunConfig.from_dict(_merge(BASE, {"parallel": par}))
        with pytest.raises(ConfigError) as exc:
            cfg.validate(world_size=par.get("pp", 1) * max(par.get("dp", 1), 1))
        return str(exc.value)

    assert "needs parallel.virtual_stages >= 2" in problems(pp=2, schedule="interleaved_1f1b")
    assert "expected one of gpipe" in problems(pp=2, schedule="nope")
    assert "pipeline_split" in problems(pp=2, pipeline_split="2,2")
    assert "divisible by pipeline ranks" in problems(pp=4, schedule="interleaved_1f1b", virtual_stages=2,
                                                    micro_batches=2)
    RunConfig.from_dict(_merge(BASE, {"parallel": {"pp": 2}})).validate(world_size=2)


def test_print_schedule_prints_and_exits_without_training(capsys):
    from chipset.cli.main import main

    rc = main(["train", "--print-schedule", "--set", "parallel.pp=2", "--set", "parallel.micro_batches=4",
               "--set", "model.num_hidden_layers=4", "--nproc", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "pipeline schedule 1f1b: 2 ranks, 4 micro-batches" in out
    assert "rank 1: .  F0 B0 B0" in out
    assert "virtual stage 0 (rank 0): units 0-2 (embed_tokens, layers.0, layers.1)" in out
    assert "step " not in out  # nothing trained


# --------------------------------------------------------------------------------------
# The jobs (run under torchrun or as one process)
# --------------------------------------------------------------------------------------


def _run_variant(b, overrides: dict) -> dict:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, overrides)).validate(world_size=b.collective.world_size())
    res = train(cfg, b, None, out=io.StringIO(), keep_params=True)
    peaks = [m["peak_memory_bytes_per_rank"] for m in res.metrics if m.get("peak_memory_bytes_per_rank")]
    return {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics], "params": res.params,
            "peaks": peaks}


def _pipeline_step_probe(b, schedule: str, m: int, delay: tuple[float, float] | None, seqs: int = 4,
                         seq_len: int = 64) -> dict:
    """One pp2 engine: peak memory of a step over the memory before it; compute timings with ``delay``.

    ``seqs`` sequences of ``seq_len`` tokens per micro-batch.
    """
    from chipset.train import build
    from chipset.train.config import RunConfig

    over = {"parallel": {"pp": 2, "schedule": schedule, "micro_batches": m},
            "train": {"global_batch": seqs * m, "seq_len": seq_len}}
    cfg = RunConfig.from_dict(_merge(BASE, over)).validate(world_size=b.collective.world_size())
    engine, data, dims = build(cfg, b)
    col = b.collective
    batches = [data.batch(0, 0, 1, i, m, device=engine.device) for i in range(m)]
    engine.forward_backward_step(batches)  # warm up (allocator, first-touch)
    engine.step(1e-3)
    out = {}
    gc.collect()
    b.memory.reset_peak_stats()
    base = b.memory.stats().allocated
    if delay:
        engine.compute_delay = delay
    col.barrier()
    engine.forward_backward_step(batches)
    out["activation_peak"] = b.memory.stats().peak_allocated - base
    engine.step(1e-3)
    # Timings of every compute instruction, gathered to every rank (same clock: one host).
    t = torch.tensor([[s, e] for _, s, e in engine.timings], dtype=torch.float64)
    allt = torch.zeros((col.world_size(), *t.shape), dtype=torch.float64)
    allt[col.rank()] = t
    col.all_reduce(allt, "sum")
    start, end = allt[..., 0].min(), allt[..., 1].max()
    busy = (allt[..., 1] - allt[..., 0]).sum(-1)  # per rank
    out["bubble"] = float((end - start) / busy.mean() - 1)
    out["theory"] = engine.schedule.theoretical_bubble()
    del engine
    gc.collect()
    return out


def _resumed_run(b) -> dict:
    """pp2 1F1B: 2 steps, state_dict, a fresh engine loads it and runs the remaining steps."""
    from chipset.train import build
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, VARIANTS[2]["pp2_1f1b"])).validate(world_size=b.collective.world_size())
    losses = []

    def run(engine, data, steps):
        for step in steps:
            batches = [data.batch(step, 0, 1, i, M, device=engine.device) for i in range(M)]
            mb_losses = engine.forward_backward_step(batches)
            losses.append(float(torch.tensor([sum(mb_losses) / M], dtype=torch.float32)))  # as train() does
            engine.step(cfg.train.lr)

    first, data, _ = build(cfg, b)
    run(first, data, range(2))
    state = first.state_dict()
    del first
    second, data, _ = build(cfg, b)
    second.load_state_dict(state)
    run(second, data, range(2, STEPS))
    from chipset.runtime.digest import params_digest

    full = second.full_parameters()
    # The digest each stage hashes shard by shard, exchanged as 32-byte hashes over pp, equals
    # the digest of the whole model gathered on one rank.
    return {"losses": losses, "params": full, "digest": second.params_digest(), "full_digest": params_digest(full)}


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    world = b.collective.world_size()
    results: dict = {"world_size": world}
    if mode == "ref":
        results["ref"] = _run_variant(b, {})
    else:
        for name, over in VARIANTS[world].items():
            results[name] = _run_variant(b, over)
        if world == 2:
            results["resumed"] = _resumed_run(b)
            results["memory"] = {s: _pipeline_step_probe(b, s, 8, None)["activation_peak"] for s in ("gpipe", "1f1b")}
            # A sleep per forward/backward (backward = 2 x forward) makes the step schedule-bound:
            # the model's own compute (one 16-token sequence per micro-batch) is ~1% of it, so
            # a loaded host shifts the measurement little (issue 5 asks for 10% of theory).
            results["bubble"] = {s: _pipeline_step_probe(b, s, 4, (0.25, 0.5), seqs=1, seq_len=16)
                                 for s in ("gpipe", "1f1b")}
    multirank.finish(b, results, out_path)


# --------------------------------------------------------------------------------------
# Parity tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(4)
    # The reference runs beside the 4-rank job; the 2-rank job (which times the bubble) runs alone.
    got = multirank.run_jobs(HERE, [{"w4": 4, "ref": 1}, {"w2": 2}], tmp_path_factory.mktemp("pp"))
    return {k: v for res in got.values() for k, v in res.items() if k != "world_size"}


N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


@pytest.mark.parametrize("variant", [*VARIANTS[2], *VARIANTS[4]])
def test_pipeline_losses_and_params_equal_single_process(runs, variant):
    ref = runs["ref"]
    parity.assert_losses_close(runs[variant]["losses"], ref["losses"], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(runs[variant]["grad_norms"], ref["grad_norms"], n=N_REDUCE, depth=DEPTH)
    tr = BASE["train"]
    parity.assert_params_within_adam_bound(runs[variant]["params"], ref["params"], lrs=[tr["lr"]] * STEPS,
                                           beta1=0.9, beta2=0.95)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # training moved: equality is not vacuous
    assert all(n > BASE["train"]["grad_clip"] for n in ref["grad_norms"])  # clipping active: global norm matters


def test_pipeline_engine_state_round_trip_resumes_exactly(runs):
    got, want = runs["resumed"], runs["pp2_1f1b"]
    assert got["losses"] == want["losses"]
    for k, v in want["params"].items():
        assert torch.equal(got["params"][k], v), k


def test_1f1b_peak_activation_memory_is_below_gpipe(runs):
    mem = runs["memory"]
    assert mem["1f1b"] < 0.6 * mem["gpipe"], mem


@pytest.mark.parametrize("variant", [*VARIANTS[2], *VARIANTS[4]])
def test_peak_memory_does_not_grow_from_step_to_step(runs, variant):
    """After the first step (which creates the optimizer state) no rank's peak grows: nothing a step
    allocates outlives it. The bound is one stage-boundary activation (the smallest tensor a step
    hands on) per step: a leak of even that much every step exceeds it, while a one-off allocation
    does not (the simulator's peaks move by a few KiB from step to step, by the threads' timing).
    A split backward under ZeRO-3 once kept each step's activations (dp2_pp2_zbv_zero3: +149 KiB a
    step on rank 0)."""
    peaks = runs[variant]["peaks"]
    if not any(any(step) for step in peaks):
        pytest.skip("the backend reports no peak memory (cpu_sim does)")
    par = _merge(BASE, {**VARIANTS[2], **VARIANTS[4]}[variant])["parallel"]
    tr = BASE["train"]
    tokens = tr["global_batch"] // (par.get("dp", 1) * M) * tr["seq_len"]
    boundary = 4 * tokens * BASE["model"]["hidden_size"]  # float32 activation between two stages
    assert len(peaks) == STEPS
    for rank, series in enumerate(zip(*peaks, strict=True)):
        assert series[-1] - series[1] < (STEPS - 2) * boundary, (rank, series)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_follows_the_schedule_not_serial_execution(runs, schedule):
    """The stages overlap as the schedule says: the measured bubble is nearer (p-1)/m than p-1.

    A schedule that serialised the two stages would measure p-1 = 1.0; gpipe and 1F1B at m = 4
    simulate 0.25. The bound is the midpoint of the two, so the test tells the two behaviours
    apart without timing the host: on an idle host the step lands within 2-3% of theory (0.256),
    at load average 13 on 2 cores 0.29, with another suite beside it 0.32. How close to theory
    the engine gets is a measurement, benchmarks/pp_bubble.py's (docs/benchmarks.md).
    """
    got = runs["bubble"][schedule]
    serial = 1.0  # p - 1 at p = 2
    print(f"measured bubble {schedule}: {got['bubble']:.3f} (theory {got['theory']:.3f}, serial {serial})")
    assert got["bubble"] < (got["theory"] + serial) / 2, got


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])


def test_pipeline_digest_hashed_per_stage_equals_the_gathered_models(runs):
    r = runs["resumed"]
    assert r["digest"] == r["full_digest"] and len(r["digest"]) == 64
