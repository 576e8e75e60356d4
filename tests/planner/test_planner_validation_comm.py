"""The planner's communication bytes against the simulator's counts, per collective type, exactly.

Real runs: every layout of benchmarks/comm_volume.py up to 4 ranks trains 2 steps on
cpu_sim (one torchrun job per world size, the trainer's ``train()`` once per layout), and
each rank's per-step ``comm`` record in metrics.jsonl must equal the planner's prediction
in the engine's units plus the engine's documented departures
(``chipset.planner.engine_comm``). The unit tests below pin the conversions and
departures that the comparison rests on, without launching anything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest

from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.comm import communication
from chipset.planner.engine_comm import departures, planned_bytes, planner_inputs, predict, stage_of
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import PRESETS
from chipset.planner.run import from_run_config
from chipset.train.config import load_config
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("comm_volume", ROOT / "benchmarks" / "comm_volume.py")
cv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cv)

DEV = DeviceProperties(name="test", index=0, total_memory=1)


def _cfg(name: str, steps: int = 2):
    return load_config(None, cv.overrides(name, steps)).validate(world_size=cv.LAYOUTS[name][0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return cv.measure(cv.DEFAULT, tmp_path_factory.mktemp("comm"), steps=2)


@pytest.mark.multirank  # cv.measure starts one torchrun job per world size
@pytest.mark.parametrize("name", cv.DEFAULT)
def test_predicted_bytes_equal_the_simulators_per_collective_every_rank_and_step(runs, name):
    records = runs[name]
    assert [r["step"] for r in records] == [1, 2]
    rows = cv.check(name, records)
    wrong = [(r["op"], r["per_rank"], r["want"]) for r in rows if not r["exact"]]
    assert not wrong, f"{name}: (op, measured per rank, predicted per rank): {wrong}"
    assert sum(r["measured"] for r in rows) > 1000  # the layout really communicated
    # Every op the engine ran is one the comparison covers.
    assert {op for rec in records for op in rec["comm"]} <= {r["op"] for r in rows}


def test_each_collective_is_counted_in_the_engines_units():
    # dp2 ZeRO-1 with no departures but the loss and norm scalars: all-gather counts its
    # input shard (S/n), a reduce-scatter its whole input (S).
    cfg = _cfg("dp2-z1")
    m, lay, train = planner_inputs(cfg)
    psi = m.num_params()
    plan = planned_bytes(cfg, "only")
    assert plan == {"reduce_scatter": 4 * psi, "all_gather": 4 * psi / 2}
    # ring-attention passes become batch_p2p sends plus the peer's matching receives
    ring = _cfg("cp2-ring")
    m, lay, train = planner_inputs(ring)
    kv_local = 2 * 4 * lay.micro_batch * (m.seq_len // 2) * m.kv_dim
    assert planned_bytes(ring, "only")["batch_p2p"] == 2 * 3 * 1 * kv_local * m.layers * 2


def test_planner_inputs_pad_the_vocabulary_and_split_the_batch_as_the_engine_does():
    m, lay, train = planner_inputs(_cfg("tp2"))
    assert m.vocab == 128 and m.kv == 2 and m.ffn == 64  # 127 padded to a multiple of tp=2
    assert lay.micro_batch == 4 and train.global_batch // lay.micro_batch == 2  # 8 sequences, 2 micro-batches
    assert train.param_bytes == train.grad_bytes == 4


def test_departures_name_what_the_engine_does_differently():
    tp = departures(_cfg("tp2"), "only")
    assert any("cross-entropy" in d.why for d in tp)
    # The blocks' tp collectives are Megatron-LM's (one region entry per attention and MLP): beyond
    # the planner only the cross-entropy's 3 float32 per token (4 sequences of 16, 2 micro-batches)
    # and the gradient-norm scalars (8 B) remain.
    assert sum(d.bytes for d in tp) == 12 * 4 * 16 * 2 + 8 and {d.op for d in tp} == {"all_reduce"}
    z2 = [d for d in departures(_cfg("dp2-z2"), "only") if d.op == "reduce_scatter"]
    m, _, _ = planner_inputs(_cfg("dp2-z2"))
    assert z2[0].bytes == -(2 - 1) * m.num_params() * 4  # one reduce-scatter per step, not per micro-batch
    # With tp, pp and ZeRO-0 on one stage and nothing else, the only departures are the scalars.
    plain = departures(_cfg("pp2-1f1b"), "first")
    assert sum(d.bytes for d in plain) == 8 + 8 and {d.op for d in plain} == {"all_reduce"}


def test_pipeline_stages_are_told_apart_by_rank():
    cfg = _cfg("tp2-pp2")
    assert [stage_of(cfg, r) for r in range(4)] == ["first", "first", "last", "last"]
    first, last = predict(cfg, 0), predict(cfg, 3)
    assert last["all_reduce"] > first["all_reduce"]  # the logits' cross-entropy all-reduces on the last stage
    assert first["batch_p2p"] == last["batch_p2p"]


def test_the_comparison_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="recompute"):
        planner_inputs(load_config(None, [*cv.MODEL, "train.recompute=\"full\""]).validate(world_size=1))
    deep = load_config(None, [*cv.MODEL, "model.num_hidden_layers=4", "parallel.pp=4"]).validate(world_size=4)
    with pytest.raises(ValueError, match="pp <= 2"):
        stage_of(deep, 1)


def test_stage_aware_pipeline_sends_and_tensor_parallel_edges():
    m = PRESETS["llama2-7b"]
    train = TrainSpec(global_batch=8)
    cl = Cluster(2, 8, DEV)
    lay = Layout(tp=2, pp=2, micro_batch=1, sequence_parallel=False, schedule="interleaved_1f1b", virtual_stages=2)
    sends = {st: next(i.calls for i in communication(m, lay, train, cl, stage=st) if i.dim == "pp")
             for st in (None, "first", "last")}
    assert sends == {None: 2 * 2 * 8, "first": 3 * 8, "last": 3 * 8}  # (2v-1)m at the ends, 2vm in the middle
    flat = Layout(tp=2, micro_batch=1, sequence_parallel=False)
    tp = next(i for i in communication(m, flat, train, cl) if i.dim == "tp")
    assert tp.calls == (m.layers * 4 + 2) * 8  # embedding forward and output layer backward, both here
    assert math.isclose(tp.buffer, 2 * m.seq_len * m.hidden)
    with pytest.raises(ValueError, match="stage"):
        communication(m, flat, train, cl, stage="first")


def test_the_comparison_catches_a_single_byte_on_one_rank():
    cfg = _cfg("ep2")
    want = [predict(cfg, r) for r in range(2)]

    def records(shift: dict[tuple[str, int], int]) -> list[dict]:
        comm = {op: {"calls": [1, 1], "bytes": [int(w[op]) + shift.get((op, r), 0) for r, w in enumerate(want)]}
                for op in ("all_reduce", "all_to_all")}
        return [{"step": 1, "comm": comm}]

    assert all(r["exact"] for r in cv.check("ep2", records({})))
    off = {r["op"]: r["exact"] for r in cv.check("ep2", records({("all_reduce", 1): 1}))}
    assert off == {"all_reduce": False, "all_to_all": True}
    # all-to-all: routing may move tokens between ranks, never change the group's sum
    moved = {r["op"]: r["exact"] for r in cv.check("ep2", records({("all_to_all", 0): 64, ("all_to_all", 1): -64}))}
    assert moved["all_to_all"]
    grown = {r["op"]: r["exact"] for r in cv.check("ep2", records({("all_to_all", 0): 64}))}
    assert not grown["all_to_all"]
    # an op the prediction does not expect at all is a mismatch too
    extra = records({})
    extra[0]["comm"]["broadcast"] = {"calls": [1, 1], "bytes": [8, 8]}
    assert {r["op"]: r["exact"] for r in cv.check("ep2", extra)}["broadcast"] is False


@pytest.mark.multirank  # two 2-rank CLI runs
def test_full_recompute_reruns_the_tensor_parallel_all_reduces_the_planner_says(tmp_path):
    """tp=2 with and without full recompute on cpu_sim: the engine's extra all-reduce calls per
    step equal the planner's. Its recompute stops before each block's MLP output projection
    (torch's early stop), so one all-reduce per block is rerun, not two: a planner that
    reruns the whole forward (recompute_early_stop False) predicts twice the difference."""
    calls = {}
    for rc in ("none", "full"):
        out = tmp_path / rc
        r = run_cli("train", "--nproc", "2", "--set", "parallel.tp=2", "--set", f"train.recompute={rc}",
                    "--set", "train.steps=2", "--run-dir", str(out), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        per_rank = [rec["comm"]["all_reduce"]["calls"] for rec in records if "comm" in rec][-1]
        assert len(set(per_rank)) == 1, per_rank
        calls[rc] = per_rank[0]
    cfg = load_config(None, ["parallel.tp=2", "train.recompute=full"]).validate(world_size=2)
    m, lay, train = from_run_config(cfg, world_size=2)
    cl = Cluster(1, 2, DEV)
    planned = {}
    for rc, early in (("none", True), ("full", True), ("whole", False)):
        lay_rc = dataclasses.replace(lay, recompute="none" if rc == "none" else "full")
        items = communication(m, lay_rc, dataclasses.replace(train, recompute_early_stop=early), cl, m.seq_len)
        planned[rc] = sum(i.calls for i in items if i.dim == "tp")
    assert calls["full"] - calls["none"] == planned["full"] - planned["none"] > 0, (calls, planned)
    assert planned["whole"] - planned["none"] == 2 * (planned["full"] - planned["none"])
