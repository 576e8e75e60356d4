"""chipset diagnose on real MoE runs: a router sent nearly every token to one expert, and a balanced one.

Two one-rank jobs of 6 steps, 4 experts, top-1, capacity factor 1.25: on a text file of one byte
repeated, every token has the same hidden state, so each MoE layer routes all of them to one
expert (4x the mean load, 1 - 1.25/4 = 69% of the choices dropped by capacity); on the seeded
synthetic stream the load is spread. Each test reads ``chipset diagnose --json``."""

from __future__ import annotations

import json

import pytest

import testenv
from chipset.cli.main import main
from testenv import SideBySide

pytestmark = pytest.mark.multirank

MOE = ["train.steps=6", "train.global_batch=4", "model.vocab_size=256", "model.num_experts=4",
       "model.num_experts_per_tok=1", "model.capacity_factor=1.25"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("diagnose_moe")
    (base / "same.txt").write_text("a" * 20000)

    def job(name, sets):
        def start():
            env = testenv.clean_env()
            env["OMP_NUM_THREADS"] = "1"
            r = testenv.chipset_train(base / name, 1, [*MOE, *sets], env=env, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            return base / name
        return start

    started = SideBySide({"skewed": job("skewed", ["data.source=text", f"data.path={base / 'same.txt'}"]),
                          "balanced": job("balanced", [])})
    yield started
    started.close()


def _diagnose(run_dir, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diagnose", str(run_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_collapsed_router_is_the_first_finding(runs, capsys):
    code, out = _diagnose(runs["skewed"], capsys)
    first = out["findings"][0]
    assert (first["kind"], first["severity"], first["step"], code) == ("moe_routing_skew", "error", 2, 1)
    ev = first["evidence"]
    assert ev["skewed_layers"] == [0, 1] and ev["mean_max_over_mean"] == 4.0
    assert ev["dropped_share"] == pytest.approx(1 - 1.25 / 4)  # capacity ceil(1.25 * 16 / 4) = 5 of 16 per sequence
    assert ev["expert"] in ev["top_expert_per_step"] and 0 <= ev["expert"] < 4


def test_a_balanced_router_records_its_load_and_has_no_skew_finding(runs, capsys):
    recs = [json.loads(line) for line in (runs["balanced"] / "metrics.jsonl").read_text().splitlines()]
    assert all([d["layer"] for d in r["moe"]] == [0, 1] and r["moe"][0]["choices"] == 4 * 16 for r in recs)  # 4 sequences x 16 tokens x top-1
    assert "moe_routing_skew" not in [f["kind"] for f in _diagnose(runs["balanced"], capsys)[1]["findings"]]
