"""Pipelines whose stage count does not divide the blocks (issue 37): the split, its time and memory,
the search and ``--fix`` over it, and BLOOM-176B (70 blocks on 12 stages) in the published table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from chipset.cli.main import main
from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties
from chipset.parallel.split import parse_split
from chipset.planner.cluster import Cluster
from chipset.planner.comm import communication
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import (
    memory_per_device,
    memory_per_stage,
    params_per_device,
    pipeline_positions,
)
from chipset.planner.model import PRESETS, ModelSpec
from chipset.planner.search import search
from chipset.planner.stages import (
    interleave_depths,
    pipeline_split,
    stage_block_counts,
    virtual_stage_blocks,
)
from chipset.planner.time import evaluate

A100 = DeviceProperties(name="a100-like", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 312e12},
                        memory_bandwidth=2.039e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                        intra_node_latency=5e-6, inter_node_latency=10e-6)
# BLOOM-176B's shape (BigScience 2022): GeLU, LayerNorm, biases, ALiBi, tied embeddings, no flash attention.
BLOOM = ModelSpec(name="bloom-176b", layers=70, hidden=14336, heads=112, ffn_hidden=4 * 14336, vocab=250880,
                  seq_len=2048, mlp="gelu", norm="layernorm", bias=True, position="alibi", tied_embeddings=True,
                  dropout=True, flash_attention=False)
BLOOM_LAYOUT = Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, recompute="full", sequence_parallel=False)
BLOOM_TRAIN = TrainSpec(global_batch=2048)
JEAN_ZAY = Cluster(48, 8, dataclasses.replace(A100, inter_node_bandwidth=6.25e9))


# --- the split ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layers", "pp", "expect"), [
    (70, 12, (5,) + (6,) * 10 + (5,)),  # BLOOM: the first and last stage one block short
    (126, 16, (7,) + (8,) * 14 + (7,)),  # Llama 3 405B (Dubey et al. 2024, Sec. 3.3.2)
    (96, 8, (12,) * 8),  # even: unchanged
    (5, 2, (3, 2)),  # a single lighter stage is the last (it also runs the head)
    (13, 12, (1,) * 10 + (2, 1)),  # more lighter stages than two: the first ones and the last
    (24, 5, (5, 5, 5, 5, 4)),
    (22, 5, (4, 4, 5, 5, 4)),
])
def test_stages_get_floor_and_ceil_blocks_with_the_first_and_last_lighter(layers, pp, expect):
    counts = stage_block_counts(layers, pp)
    assert counts == expect and sum(counts) == layers
    assert max(counts) - min(counts) <= 1
    assert counts[0] == min(counts) or pp - layers % pp == 1  # the first is light unless only one is
    assert counts[-1] == min(counts)


def test_a_stage_without_a_block_is_refused():
    with pytest.raises(ValueError, match="each stage needs a block"):
        stage_block_counts(3, 4)
    with pytest.raises(ConfigError, match=r"pp \(4\) must be at most layers \(2\)"):
        evaluate(PRESETS["tiny"], Layout(pp=4), TrainSpec(global_batch=8), Cluster(1, 4, A100))


@pytest.mark.parametrize(("layers", "pp"), [(70, 12), (126, 16), (30, 4), (13, 12), (5, 2), (96, 8), (60, 4)])
def test_every_split_the_planner_searches_is_one_chipset_train_accepts(layers, pp):
    """pipeline_split() is what ``parallel.pipeline_split`` must say for chipset train to run the
    planned split; the engine's own parser accepts it for every interleaving depth searched."""
    for v in [1, *interleave_depths(layers, pp)]:
        chunks = virtual_stage_blocks(layers, pp, v)
        assert len(chunks) == pp * v and sum(chunks) == layers
        per_rank = [sum(chunks[j * pp + r] for j in range(v)) for r in range(pp)]
        assert tuple(per_rank) == stage_block_counts(layers, pp)
        text = pipeline_split(layers, pp, v)
        if layers % (pp * v) == 0:
            assert text == ""  # even: the engine's default split
        else:
            assert parse_split(text, pp * v, layers) == list(chunks)


def test_interleaving_depths_are_megatrons_when_pp_divides_the_layers():
    assert interleave_depths(96, 8) == [2, 3, 4, 6]  # divisors of 12 up to 8
    assert interleave_depths(60, 4) == [3, 5]
    assert interleave_depths(70, 12) == [2, 3, 6]  # 6: one block per chunk, edge chunks empty
    assert interleave_depths(126, 16) == [2, 4, 8]  # Llama 3: the first chunk holds only the embedding
    assert virtual_stage_blocks(126, 16, 8)[0] == 0 and virtual_stage_blocks(126, 16, 8)[-1] == 0


# --- time and memory ------------------------------------------------------------------------------


def _rounded(m: ModelSpec, lay: Layout, up: bool) -> ModelSpec:
    """``m`` with its blocks rounded to a multiple of p·v: every stage and chunk perfectly balanced."""
    q = lay.pp * lay.v
    return dataclasses.replace(m, layers=(-(-m.layers // q) if up else m.layers // q) * q)


CASES = [
    (BLOOM, BLOOM_LAYOUT, BLOOM_TRAIN, JEAN_ZAY),
    (BLOOM, dataclasses.replace(BLOOM_LAYOUT, recompute="none", micro_batch=1), BLOOM_TRAIN, JEAN_ZAY),
    (BLOOM, dataclasses.replace(BLOOM_LAYOUT, schedule="gpipe"), BLOOM_TRAIN, JEAN_ZAY),
    (BLOOM, dataclasses.replace(BLOOM_LAYOUT, schedule="interleaved_1f1b", virtual_stages=2), BLOOM_TRAIN, JEAN_ZAY),
    (BLOOM, dataclasses.replace(BLOOM_LAYOUT, schedule="interleaved_1f1b", virtual_stages=3), BLOOM_TRAIN, JEAN_ZAY),
    # a small vocabulary: the heavier middle stage is the slowest; a huge one: the last stage
    (dataclasses.replace(PRESETS["llama2-7b"], layers=30), Layout(dp=2, tp=1, pp=4, zero=1), TrainSpec(global_batch=32),
     Cluster(1, 8, A100)),
    (dataclasses.replace(PRESETS["llama3-8b"], layers=30, vocab=512_000), Layout(dp=2, tp=2, pp=4, zero=2),
     TrainSpec(global_batch=32), Cluster(2, 8, A100)),
    (dataclasses.replace(PRESETS["mixtral-8x7b"], layers=31), Layout(dp=4, tp=2, pp=2, ep=4, zero=1),
     TrainSpec(global_batch=32), Cluster(2, 8, A100)),
    (PRESETS["llama3-405b"], Layout(dp=1, tp=8, pp=16, zero=1, schedule="interleaved_1f1b", virtual_stages=4),
     TrainSpec(global_batch=64), Cluster(16, 8, A100)),
]


@pytest.mark.parametrize(("m", "lay", "train", "cl"), CASES)
def test_an_uneven_split_is_bounded_by_the_balanced_models_below_and_above(m, lay, train, cl):
    """Never faster, nor lighter, than the same model with its blocks rounded down to a count every
    stage and chunk can share evenly; never slower, nor heavier, than with them rounded up."""
    assert m.layers % (lay.pp * lay.v)
    uneven = evaluate(m, lay, train, cl)
    below = evaluate(_rounded(m, lay, up=False), lay, train, cl)
    above = evaluate(_rounded(m, lay, up=True), lay, train, cl)
    # 1e-3: the forward/backward split of a slot that data-parallel overlap uses is the whole model's
    # (flops.py), so a model with fewer blocks hides its gradient traffic a hair differently.
    assert below.step_time_s <= uneven.step_time_s * (1 + 1e-3)
    assert uneven.step_time_s <= above.step_time_s
    assert below.memory.total <= uneven.memory.total <= above.memory.total
    assert uneven.stage_blocks == stage_block_counts(m.layers, lay.pp)


def test_the_step_is_paced_by_the_slowest_stage():
    """Per micro-batch the pipeline moves at its slowest stage: a middle stage with ⌈l/p⌉ blocks,
    or the last with ⌊l/p⌋ blocks and the head, whichever is slower; the bubble is p - 1 of it."""
    train, cl = TrainSpec(global_batch=32), Cluster(1, 8, A100)
    lay = Layout(dp=2, pp=4, zero=1)
    small = dataclasses.replace(PRESETS["llama2-7b"], layers=30)
    huge = dataclasses.replace(small, vocab=1_024_000)
    assert evaluate(small, lay, train, cl).slowest_stage == "middle"
    assert evaluate(huge, lay, train, cl).slowest_stage == "last"
    first_heavy = dataclasses.replace(small, layers=31)  # 8, 8, 8, 7: only the last is lighter
    p = evaluate(first_heavy, lay, train, cl)
    assert p.stage_blocks == (8, 8, 8, 7) and p.slowest_stage in ("first", "last")
    # Adding a block to a light stage (30 -> 31 -> 32) never makes the step faster.
    times = [evaluate(dataclasses.replace(small, layers=n), lay, train, cl).step_time_s for n in (28, 29, 30, 31, 32)]
    assert times == sorted(times)


def test_memory_is_the_most_loaded_stages():
    """70 blocks on 12 stages, 1F1B: the second rank holds 6 blocks x 11 micro-batches in flight,
    more than the first (5 x 12, plus the embedding's output); the device memory is its peak."""
    lay = dataclasses.replace(BLOOM_LAYOUT, recompute="none", micro_batch=1)
    stages = memory_per_stage(BLOOM, lay, BLOOM_TRAIN)
    assert list(stages) == ["first", "middle", "last"]
    assert pipeline_positions(BLOOM, lay) == {"first": (0, 5), "middle": (1, 6), "last": (11, 5)}
    assert stages["middle"].activations > stages["first"].activations
    assert memory_per_device(BLOOM, lay, BLOOM_TRAIN).total == max(b.total for b in stages.values())
    params, _ = params_per_device(BLOOM, lay)
    block = params["middle"] / 6
    assert params["first"] == pytest.approx(5 * block + BLOOM.vocab * BLOOM.hidden / 4)  # the embedding
    assert params["last"] == pytest.approx(5 * block + BLOOM.vocab * BLOOM.hidden / 4 + BLOOM.norm_params())
    # Even splits keep two positions: a middle rank never needs more than the first.
    even = dataclasses.replace(BLOOM, layers=72)
    assert list(memory_per_stage(even, lay, BLOOM_TRAIN)) == ["first", "last"]


def test_a_middle_stage_sends_on_both_sides_and_runs_no_edge_collectives():
    lay = dataclasses.replace(BLOOM_LAYOUT, micro_batch=2)
    mb = BLOOM_TRAIN.global_batch // (lay.dp * lay.micro_batch)
    middle = communication(BLOOM, lay, BLOOM_TRAIN, JEAN_ZAY, stage="middle")
    first = communication(BLOOM, lay, BLOOM_TRAIN, JEAN_ZAY, stage="first")
    calls = lambda items, dim: next(i.calls for i in items if i.dim == dim)  # noqa: E731
    assert calls(middle, "pp") == 2 * mb and calls(first, "pp") == mb
    assert calls(middle, "tp") == 6 * 6 * mb  # 6 blocks x 6 all-reduces (full recompute), no edge call
    assert calls(first, "tp") == (5 * 6 + 1) * mb


# --- search, --fix and the CLI --------------------------------------------------------------------


def test_the_search_returns_an_uneven_layout_when_it_is_the_best():
    """30 blocks on 4 nodes of 8 with a slow network (2 GB/s per device across nodes): four stages of
    7-8 blocks keep the data-parallel traffic off it and beat the best even split (two stages of 15)."""
    m = dataclasses.replace(PRESETS["llama2-7b"], layers=30)
    cl = Cluster(4, 8, dataclasses.replace(A100, inter_node_bandwidth=2e9))
    res = search(m, TrainSpec(global_batch=512), cl, fix={"micro_batch": 1, "recompute": "selective"})
    best = res.candidates[0]
    assert best.layout.pp == 4 and best.stage_blocks == (7, 8, 8, 7)
    even = [p for p in res.candidates if m.layers % p.layout.pp == 0]
    assert even and best.step_time_s < even[0].step_time_s
    assert "pp does not divide layers" not in res.discarded


def test_bloom_on_its_own_cluster_has_layouts_now_and_all_of_them_are_uneven():
    """BLOOM on 48 x 8 A100s: only pp 1 and 2 divide 70 among the degrees 384 devices allow, and
    neither fits in 80 GB; the planner used to find no layout, now it plans pipelines of 5-12 blocks."""
    res = search(BLOOM, BLOOM_TRAIN, JEAN_ZAY, fix={"tp": 4})
    assert res.candidates and all(BLOOM.layers % p.layout.pp for p in res.candidates)
    assert any(p.layout.pp == 12 for p in res.candidates)  # the layout BigScience ran


def test_the_search_plans_a_cluster_whose_only_layout_is_uneven():
    """10 blocks on 4 devices with nothing else to split (one head, an odd sequence, one
    sequence per step): the planner used to refuse; now every candidate is the 2-3-3-2 pipeline."""
    m = ModelSpec(name="odd", layers=10, hidden=64, heads=1, vocab=256, seq_len=127)
    res = search(m, TrainSpec(global_batch=1), Cluster(1, 4, A100))
    assert res.candidates and {p.layout.pp for p in res.candidates} == {4}
    assert {p.stage_blocks for p in res.candidates} == {(2, 3, 3, 2)}


def test_fixing_pp_that_does_not_divide_the_layers_evaluates_it():
    fix = {"dp": 8, "tp": 4, "pp": 12, "cp": 1, "zero": 1, "micro_batch": 2, "schedule": "1f1b",
           "recompute": "full", "sequence_parallel": False}
    res = search(BLOOM, BLOOM_TRAIN, JEAN_ZAY, fix=fix)
    assert res.configurations_evaluated == 1 and res.fixed_only is not None
    assert res.fixed_only.layout.pp == 12 and res.fixed_only.stage_blocks[0] == 5


@pytest.fixture
def _profile(monkeypatch):
    import chipset.planner.cluster as cluster

    monkeypatch.setattr(cluster, "all_profiles", lambda: {"a100-like": ("testbackend", A100)})


def test_chipset_plan_plans_bloom_on_12_stages_end_to_end(capsys, _profile):
    args = ["plan", "--preset", "gpt3-175b", "--cluster", "48x8:a100-like", "--global-batch", "2048",
            "--inter-node-bw", "6.25", "--top", "3",
            *(f"--set=model.{k}={v}" for k, v in (("layers", 70), ("hidden", 14336), ("heads", 112),
                                                   ("ffn_hidden", 57344), ("vocab", 250880),
                                                   ("position", "alibi"))),
            "--fix", "parallel.tp=4,parallel.pp=12,parallel.recompute=full"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cuts the 70 blocks into pp=12 stages" in out
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["pp"] == 12 for r in rows)


# --- the published table --------------------------------------------------------------------------


def test_bloom_is_in_the_published_table_with_its_uneven_split():
    from chipset.planner.published import RUNS, predict

    run = next(r for r in RUNS if r.label.startswith("BLOOM 176B"))
    assert run.tflops == 156 and "2211.05100" in run.source and run.gpus == 384
    assert run.model.num_params() + 2 * run.model.hidden == 176_247_271_424  # + the embedding LayerNorm
    p = predict(run, {"a100-80g": ("t", A100)})
    assert p.layout.pp == 12 and p.stage_blocks == (5,) + (6,) * 10 + (5,)
    assert (p.layout.tp, p.layout.dp, p.layout.zero, p.layout.micro_batch) == (4, 8, 1, 2)
