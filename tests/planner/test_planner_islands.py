"""The planner's islands terms (planner/islands.py, docs/islands.md "Planning islands"): the bytes of an
outer step, the break-even H, and their surfaces (`chipset train --project`, `chipset plan`).

The bytes are checked against chipset's own accounting of a real job: 2 islands of 2 dp ranks each
on cpu_sim with int8 pseudo-gradients (per-rank slices and per-block scales both matter there).
"""

from __future__ import annotations

import json
import sys

import pytest

import forked_cli
import testenv
from chipset.errors import ConfigError
from chipset.planner.islands import (
    INT8_BLOCK,
    LinkSpec,
    break_even_sync_every,
    exchange_calls,
    islands_for_config,
    outer_fraction,
    outer_step_bytes,
    sync_step_time,
)
from chipset.planner.projection import resolve_profile
from chipset.train.config import resolve_config

MODEL = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=2", "model.intermediate_size=64", "model.vocab_size=256"]
JOB = ["train.steps=4", "train.global_batch=8", "train.seq_len=32", "train.checkpoint_every=0", *MODEL,
       "islands.count=2", "islands.sync_every=2", 'islands.pseudo_grad_dtype="int8"']
# This model's parameters: embedding and head 2 x 256 x 32, two blocks of 4 x 32^2 + 3 x 32 x 64 + 2 x 32,
# the final norm 32: 37,024; each of an island's 2 dp ranks owns 18,512 of them.
PARAMS = 2 * 256 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32


def _sets(sets):
    return [a for s in sets for a in ("--set", s)]


def _cli(*args, timeout: float = 600):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_break_even_h_by_hand():
    # outer 2 s, inner 0.1 s, at most 5%: H >= 2 x 0.95 / (0.05 x 0.1) = 380; 2 / (38 + 2) = 5.0%, H = 379 gives 5.01%
    assert break_even_sync_every(2.0, 0.1, 0.05) == 380
    assert outer_fraction(2.0, 0.1, 380) == pytest.approx(0.05) and outer_fraction(2.0, 0.1, 379) > 0.05
    # outer 1 s, inner 0.3 s, at most 20%: 0.8 / 0.06 = 13.3 -> 14 (1 / 5.2 = 19.2%; 13: 1 / 4.9 = 20.4%)
    assert break_even_sync_every(1.0, 0.3, 0.2) == 14
    assert break_even_sync_every(0.001, 1.0, 0.05) == 1  # an outer step cheaper than the target at H = 1


def test_delayed_overlap_by_hand():
    """islands.overlap = "delayed": the link's 1.5 s of a 2 s outer step runs beside the next H inner steps."""
    # H = 10 at 0.1 s: the exchange (1.5 s) outlasts the inner steps (1 s) by 0.5 s; 0.5 s of the
    # island's own part: a round takes max(1, 1.5) + 0.5 = 2 s, 0.2 s per step (blocking: 0.3 s)
    assert sync_step_time(2.0, 0.1, 10, 1.5) == pytest.approx(0.2)
    assert sync_step_time(2.0, 0.1, 10) == pytest.approx(0.3)
    assert outer_fraction(2.0, 0.1, 10, 1.5) == pytest.approx((0.5 + 0.5) / 2.0)
    # hidden from H = 15 on: then only the 0.5 s count: 0.5 / (0.1 H + 0.5) <= 5% from H = 95 (blocking: 380)
    assert break_even_sync_every(2.0, 0.1, 0.05, 1.5) == 95
    assert outer_fraction(2.0, 0.1, 95, 1.5) == pytest.approx(0.05) and outer_fraction(2.0, 0.1, 94, 1.5) > 0.05
    # all of it on the link (1 s), inner 0.3 s, at most 20%: (1 - 0.3 H) / 1 <= 0.2 from H = 3 (2: 40%)
    assert break_even_sync_every(1.0, 0.3, 0.2, 1.0) == 3
    assert sync_step_time(1.0, 0.3, 3, 1.0) == pytest.approx(1.0 / 3)  # the link sets the pace
    assert sync_step_time(1.0, 0.3, 4, 1.0) == pytest.approx(0.3)  # hidden: the inner step does


def test_outer_step_bytes_by_hand():
    n = PARAMS // 2
    assert exchange_calls(n, "fp32") == [("all_reduce", 4 * n)]
    assert exchange_calls(n, "bf16") == [("all_gather", 2 * n)]
    # int8: the codes, and one float32 scale per 2048 elements of this rank's slice: ceil(18512 / 2048) = 10
    assert INT8_BLOCK == 2048
    assert exchange_calls(n, "int8") == [("all_gather", n), ("all_gather", 40)]
    assert exchange_calls(n, "fp32", secure=True) == [("all_reduce", 8 * n)]
    # sent over 4 islands: a ring all-reduce 2 x 3/4 of its buffer, an all-gather 3 x its input
    assert outer_step_bytes(n, "fp32", 4) == (4 * n, 1.5 * 4 * n)
    assert outer_step_bytes(n, "bf16", 4) == (2 * n, 3 * 2 * n)


def test_terms_add_up():
    cfg = resolve_config(None, JOB, world_size=4)
    dev = resolve_profile("h100-sxm", cfg.train.dtype)
    t = islands_for_config(cfg, 2, dev, LinkSpec(1.25e9, 1e-3, 0.05), t_inner=2e-3)
    assert t["elements_per_rank"] == PARAMS // 2 and t["bytes_per_island"] == 2 * t["bytes_per_rank"]
    assert t["outer_time_s"] == pytest.approx(t["outer_link_s"] + t["outer_host_s"] + t["outer_update_s"]
                                              + t["outer_refresh_s"])
    # two all-gathers between 2 islands: 1 latency step each; both ranks share the 1.25 GB/s link
    assert t["outer_link_s"] == pytest.approx(2 * 1e-3 + 2 * (PARAMS // 2 + 40) / 1.25e9)
    assert t["step_time_s"] == pytest.approx(2e-3 + t["outer_time_s"] / 2)
    h = t["break_even_sync_every"]
    assert outer_fraction(t["outer_time_s"], 2e-3, h) <= 0.05 < outer_fraction(t["outer_time_s"], 2e-3, h - 1)
    assert t["speedup_over_dp"] == pytest.approx(t["dp_step_time_s"] / t["step_time_s"])
    d = islands_for_config(resolve_config(None, [*JOB, 'islands.overlap="delayed"'], world_size=4), 2, dev,
                           LinkSpec(1.25e9, 1e-3, 0.05), t_inner=2e-3)
    fixed = t["outer_time_s"] - t["outer_link_s"]
    assert d["outer_time_s"] == t["outer_time_s"] and d["outer_hidden_s"] == pytest.approx(min(t["outer_link_s"], 4e-3))
    assert d["step_time_s"] == pytest.approx(max(2e-3, t["outer_link_s"] / 2) + fixed / 2)
    assert d["step_time_s"] < t["step_time_s"]


@pytest.mark.parametrize("link, says", [
    (LinkSpec(0.0), "inter-island bandwidth 0 GB/s: expected a positive"),
    (LinkSpec(-1e9), "expected a positive"),
    (LinkSpec(1e9, target=1.0), "in (0, 1)"),
    (LinkSpec(1e9, latency=-1.0), "expected seconds >= 0"),
])
def test_bad_link_is_refused(link, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        link.check()


def test_bad_bandwidth_exits_2_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    r = _cli("train", "--nproc", "2", "--run-dir", str(run_dir), "--project", "h100-sxm", "--inter-island-bw", "0",
             *_sets(JOB))
    assert r.returncode == 2 and "inter-island bandwidth 0 GB/s" in r.stderr, r.stdout + r.stderr
    assert not run_dir.exists()
    r = _cli("train", "--nproc", "2", "--run-dir", str(run_dir), "--project", "h100-sxm", "--inter-island-bw", "1",
             *_sets(MODEL))
    assert r.returncode == 2 and "islands.count >= 2" in r.stderr, r.stdout + r.stderr
    r = _cli("plan", "--preset", "llama2-7b", "--cluster", "1x8:h100-sxm", "--islands", "2", "--outer-target", "1.5")
    assert r.returncode == 2 and "in (0, 1)" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plan_shows_the_islands_of_its_best_layout():
    r = _cli("plan", "--preset", "llama2-7b", "--cluster", "1x8:h100-sxm", "--islands", "4", "--sync-every", "500",
             "--inter-island-bw", "1.25", "--top", "1")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("chipset plan: islands:")]
    assert len(lines) == 3, r.stdout
    assert "4 x 8 rank(s), H = 500, fp32" in lines[0] and "break-even H = " in lines[2]
    # the islands of a config (examples/islands-tiny.toml: 2 islands, H = 10, bf16), in --json too
    r = _cli("plan", str(testenv.TESTS.parent / "examples" / "islands-tiny.toml"), "--cluster", "1x1:h100-sxm", "--json",
             "--top", "1")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)[0]["islands"]
    assert (t["islands"], t["sync_every"], t["pseudo_grad_dtype"]) == (2, 10, "bf16")
    assert t["inter_island_bw_source"].startswith("the profile's inter-node bandwidth")


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("islandplan") / "run"
    r = _cli("train", "--nproc", "4", "--run-dir", str(run_dir), "--project", "h100-sxm", "--inter-island-bw", "1.25",
             *_sets(JOB))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir, r.stdout


@pytest.mark.multirank
def test_predicted_outer_step_bytes_are_what_the_link_counted(projected):
    run_dir, _ = projected
    s = json.loads((run_dir / "summary.json").read_text())
    t = s["projection"]["islands"]
    assert t["bytes_per_rank"] == PARAMS // 2 + 4 * 10  # int8 codes of the rank's half, 10 scales
    for i in range(2):  # every rank of every island, at each outer step (steps 2 and 4), nothing between
        for line in (run_dir / f"island-{i}" / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            want = t["bytes_per_rank"] if rec["step"] % 2 == 0 else 0
            assert rec["cross_island"]["bytes"] == [want, want], rec
    assert s["cross_island_bytes"] == 2 * 2 * t["bytes_per_island"]  # 2 outer steps, 2 islands


@pytest.mark.multirank
def test_project_prints_the_islands_lines_from_one_islands_step(projected):
    run_dir, out = projected
    s = json.loads((run_dir / "summary.json").read_text())
    p, t = s["projection"], s["projection"]["islands"]
    assert p["devices"] == 2 and t["ranks_per_island"] == 2 and t["inter_island_gbps"] == 1.25
    assert p["tokens_per_s"] == pytest.approx(4 * 32 / p["step_time_s"])  # an island's 8 / 2 sequences
    assert t["inner_step_s"] == p["step_time_s"]
    lines = [x for x in out.splitlines() if x.startswith("chipset train: islands:")]
    assert len(lines) == 3, out
    assert f"H = 2, int8 pseudo-gradients: {t['bytes_per_rank']:,} B per rank" in lines[0]
