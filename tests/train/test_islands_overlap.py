"""islands.overlap = "delayed" (docs/islands.md#overlapping-the-outer-step-with-the-next-inner-steps):
the outer exchange runs while the next inner steps train and is applied one outer step late.
Real `chipset train` jobs of two one-rank islands on the host gloo link."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import forked_cli
from chipset.errors import ConfigError
from chipset.train.config import resolve_config
from testenv import SideBySide, chipset_train, clean_env, selected

STEPS, H = 6, 2  # outer steps after 2 and 4 (delayed) and 6 (the last: blocking)
BASE = [f"train.steps={STEPS}", "train.global_batch=8", "train.seq_len=32", "train.dtype=\"float32\"",
        "train.optimizer=\"sgd\"", "train.lr=0.05", "train.grad_clip=0", "model.hidden_size=32",
        "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=2",
        "model.intermediate_size=64", "model.vocab_size=256", "islands.count=2", f"islands.sync_every={H}"]
DELAYED = [*BASE, 'islands.overlap="delayed"']
LR, MU = 0.5, 0.5  # the outer optimizer's defaults: nesterov, lr 0.5, momentum 0.5
INT8 = [*DELAYED, 'islands.pseudo_grad_dtype="int8"', "train.checkpoint_every=3"]  # 3: mid-way to the outer step at 4


def _env():
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    wanted = set()
    for test, keys in ((test_delayed_update_matches_a_hand_computed_reference, ("delayed",)),
                       (test_delayed_mode_sends_the_bytes_of_the_blocking_mode, ("delayed", "blocking")),
                       (test_int8_delayed_run_resumes_bit_for_bit, ("int8",))):
        if selected(request, test):
            wanted.update(keys)
    jobs = {
        "delayed": lambda: chipset_train(root / "delayed", 2, [*DELAYED, "islands.wire_log=true"], env=_env()),
        "blocking": lambda: chipset_train(root / "blocking", 2, BASE, env=_env()),
        "int8": lambda: chipset_train(root / "int8", 2, INT8, env=_env()),
    }
    side = SideBySide({k: v for k, v in jobs.items() if k in wanted})
    out = {}
    try:
        for key in [k for k in jobs if k in wanted]:
            r = side[key]
            assert r.returncode == 0, f"{key}: " + r.stdout[-3000:] + r.stderr[-3000:]
            out[key] = root / key
    finally:
        side.close()
    return out


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _wire(run_dir, island: int) -> list[dict]:
    files = sorted((run_dir / f"island-{island}" / "wire" / "rank-0").glob("*.pt"))
    return [{**torch.load(f), "name": f.name} for f in files]


def _nesterov(g, avg, buf, step):
    """The outer step by hand: Nesterov momentum SGD (buffer = avg at the first step)."""
    buf = avg.clone() if step == 1 else MU * buf + avg
    return g - LR * (avg + MU * buf), buf


@pytest.mark.multirank
def test_delayed_update_matches_a_hand_computed_reference(runs):
    """From each island's wire log (per outer step: its local parameters as the inner steps left
    them, the pseudo-gradient it sent, and the global and local parameters it went on with), the
    delayed update by hand: outer step k applies the average of step k-1's pseudo-gradients to the
    global parameters, re-bases the local ones by the change (``local += new - old``), sends
    ``new - local``, and restarts the local parameters from the new global ones; the last step
    applies its own average at once. Every island ends on the reference's final parameters."""
    logs = [_wire(runs["delayed"], i) for i in (0, 1)]
    rounds = []  # per outer step: [(local in, sent, global out, local out) per island]
    for k in range(STEPS // H):
        per = []
        for log in logs:
            rin, sent, rout = log[3 * k: 3 * k + 3]
            assert [r["op"] for r in (rin, sent, rout)] == ["outer-in", "all_reduce", "outer-out"], log
            assert not rin["sent"] and sent["sent"] and not rout["sent"]
            per.append((rin["tensors"][0], sent["tensors"][0], *rout["tensors"]))
        rounds.append(per)
    # float32: each reference value is a few roundings (<= 1/2 ulp each) of numbers no larger than
    # the parameters, chained over the outer steps: 16 ulps of the largest parameter bounds them.
    scale = max(float(t.abs().max()) for per in rounds for isl in per for t in isl)
    tol = 16 * torch.finfo(torch.float32).eps * scale
    g0 = rounds[0][0][2]
    for isl in rounds[0]:  # the first outer step has nothing to apply: the global parameters stay
        assert torch.equal(isl[2], g0) and torch.equal(isl[3], g0)
        assert torch.equal(isl[1], g0 - isl[0])
    g, buf, missed = g0, None, []
    for k in range(1, len(rounds)):
        avg = (rounds[k - 1][0][1] + rounds[k - 1][1][1]) / 2
        new, buf = _nesterov(g, avg, buf, k)
        for local_in, sent, g_out, local_out in rounds[k]:
            rebased = local_in + (new - g)
            assert (sent - (new - rebased)).abs().max() <= tol, k
            missed.append(float((sent - (new - local_in)).abs().max()))  # without the re-base
            if k < len(rounds) - 1:
                assert (g_out - new).abs().max() <= tol and torch.equal(local_out, g_out), k
        g = new
    last = (rounds[-1][0][1] + rounds[-1][1][1]) / 2
    final, _ = _nesterov(g, last, buf, len(rounds))
    for *_, g_out, local_out in rounds[-1]:
        assert (g_out - final).abs().max() <= tol and torch.equal(local_out, g_out)
    assert min(missed) > 100 * tol, (missed, tol)  # a dropped correction is far outside the tolerance
    s = _summary(runs["delayed"])
    assert s["same_parameters"] and [p["outer_steps"] for p in s["per_island"]] == [STEPS // H] * 2


@pytest.mark.multirank
def test_delayed_mode_sends_the_bytes_of_the_blocking_mode(runs):
    d, b = _summary(runs["delayed"]), _summary(runs["blocking"])
    assert d["cross_island_bytes"] == b["cross_island_bytes"] > 0
    q = json.loads((runs["delayed"] / "island-0" / "summary.json").read_text())["islands"]["quorums"]
    assert [r["step"] for r in q] == [2, 4, 6] and len({r["bytes"] for r in q}) == 1


@pytest.mark.multirank
def test_int8_delayed_run_resumes_bit_for_bit(runs, tmp_path):
    """Resumed from step 3 (the exchange of step 2 done and held, its average not yet applied; the
    int8 error-feedback residual non-zero), the job ends on the same parameters."""
    run = tmp_path / "resumed"
    shutil.copytree(runs["int8"], run)
    for i in (0, 1):
        d = run / f"island-{i}"
        shutil.rmtree(d / "checkpoints" / f"step-{STEPS:08d}")
        state = json.loads((d / "checkpoints" / "step-00000003" / "state.json").read_text())
        assert state["islands"]["held"] is True, state["islands"]
        (d / "summary.json").unlink()
    (run / "summary.json").unlink()
    r = chipset_train(run, 2, INT8, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed" in (r.stdout + r.stderr).lower()
    before = {p["params_digest"] for p in _summary(runs["int8"])["per_island"]}
    after = {p["params_digest"] for p in _summary(run)["per_island"]}
    assert len(before) == 1 and after == before


@pytest.mark.parametrize("sets, says", [
    (['islands.overlap="stream"'], "islands.overlap = 'stream': expected one of off, delayed"),
    (['islands.overlap="delayed"', "islands.secure_aggregation=true", "train.global_batch=8"],
     "federated rounds are synchronous"),
])
def test_bad_overlap_is_refused(sets, says):
    with pytest.raises(ConfigError, match=says):
        resolve_config(None, [*BASE, *sets], world_size=2)


def test_bad_overlap_exits_2_before_launch(tmp_path):
    import sys

    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--run-dir",
                        str(tmp_path / "run"), "--set", "islands.count=2", "--set", 'islands.overlap="eager"'],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "islands.overlap = 'eager'" in r.stderr and not (tmp_path / "run").exists()
