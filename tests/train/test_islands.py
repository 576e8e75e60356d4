"""Training across islands (DiLoCo / local SGD, docs/islands.md): real `chipset train` jobs of two
one-rank islands on the host gloo link, against plain dp=2 on the same data and tokens."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

import forked_cli
from chipset.errors import ConfigError
from chipset.train.config import resolve_config
from testenv import SideBySide, chipset_train, clean_env, selected

STEPS = 32
H = 16
# A tiny decoder; inner SGD with momentum and no clipping: both are linear in the gradient, so
# islands that average their parameters after every step (H = 1, outer SGD at lr 1: FedAvg) take
# exactly dp's steps, up to float32 rounding.
BASE = [f"train.steps={STEPS}", "train.global_batch=8", "train.seq_len=32", "train.dtype=\"float32\"",
        "train.optimizer=\"sgd\"", "train.lr=0.05", "train.grad_clip=0", "train.checkpoint_every=0",
        "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.num_key_value_heads=2", "model.intermediate_size=64", "model.vocab_size=256"]
FEDAVG = ["islands.count=2", "islands.sync_every=1", "islands.outer_optimizer=\"sgd\"", "islands.outer_lr=1.0"]


def _env(**extra):
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _cpu_available() -> bool:
    """The cpu backend is installed and usable (the suite disables it only to pin its selection)."""
    from chipset.loader import list_backends

    return any(r.name == "cpu" and (r.ok or r.status == "disabled") for r in list_backends())


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("islands")
    wanted = set()
    for test, keys in ((test_diloco_trains_with_16x_fewer_bytes_crossing, ("dp", "diloco")),
                       (test_fedavg_with_h1_is_dp, ("dp", "fedavg")),
                       (test_mixed_backend_islands_match_one_backend, ("fedavg", "mixed")),
                       (test_outer_state_survives_a_resume, ("diloco",)),
                       (test_planner_predicts_the_bytes_crossing, ("diloco",))):
        if selected(request, test):
            wanted.update(keys)
    jobs = {
        "dp": lambda: chipset_train(root / "dp", 2, BASE, env=_env()),
        "diloco": lambda: chipset_train(root / "diloco", 2, [*BASE, "islands.count=2", f"islands.sync_every={H}",
                                                             f"train.checkpoint_every={STEPS - 8}"], env=_env()),
        "fedavg": lambda: chipset_train(root / "fedavg", 2, [*BASE, *FEDAVG], env=_env()),
    }
    if _cpu_available():  # one island on cpu, one on cpu_sim: the launcher itself on cpu_sim
        env = _env(CHIPSET_BACKEND="cpu_sim")
        env.pop("CHIPSET_DISABLE_PLUGINS", None)
        jobs["mixed"] = lambda: chipset_train(root / "mixed", 2, [*BASE, *FEDAVG, 'islands.backends="cpu,cpu_sim"'],
                                              env=env)
    jobs = {k: v for k, v in jobs.items() if k in wanted}
    side = SideBySide(jobs)
    out = {}
    try:
        for key in jobs:
            r = side[key]
            assert r.returncode == 0, f"{key}: " + r.stdout[-3000:] + r.stderr[-3000:]
            out[key] = root / key
    finally:
        side.close()
    return out


def _losses(run_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _island_losses(run_dir) -> list[float]:
    """The job's loss per step: the mean of the two islands' (each the loss of its half of the batch)."""
    a, b = (_losses(run_dir / f"island-{i}") for i in (0, 1))
    return [(x + y) / 2 for x, y in zip(a, b, strict=True)]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _dp_bytes(run_dir) -> int:
    """Every byte dp=2's collectives handed over (all ranks, every step), from the run's comm totals."""
    return sum(t["bytes"] for t in _summary(run_dir)["comm_totals"].values())


# float32 rounding: the two paths sum the same two gradients in different orders and round the
# average once more (FedAvg averages parameters, dp gradients): an ulp or so of each parameter
# per step, which moves the loss (between 4 and 8 here, ln 256 = 5.5 at the start) by a few of
# its own ulps per step. Allowed: 4 ulps per step, accumulated over every step. A wrong outer
# step (a sum instead of the average, a wrong lr) moves the losses by 1e-2 and more.
LOSS_ULP = 4 * torch.finfo(torch.float32).eps  # the spacing of float32 values in [4, 8)
TOL = STEPS * 4 * LOSS_ULP


@pytest.mark.multirank
def test_diloco_trains_with_16x_fewer_bytes_crossing(runs):
    s = _summary(runs["diloco"])
    dp = _dp_bytes(runs["dp"])
    losses = _island_losses(runs["diloco"])
    assert losses[-1] < losses[0] - 0.1, losses  # it trains
    assert s["same_parameters"], s  # the last step ended with an outer step: one model
    assert [p["outer_steps"] for p in s["per_island"]] == [STEPS // H] * 2
    crossed = s["cross_island_bytes"]
    assert crossed > 0 and dp >= 15 * crossed, (dp, crossed)


@pytest.mark.multirank
def test_planner_predicts_the_bytes_crossing(runs):
    """planner/islands.py's bytes of an outer step are what the link counted (fp32, one rank per island;
    tests/planner/test_planner_islands.py checks int8 with 2 ranks per island)."""
    from chipset.planner.islands import outer_step_bytes, owned_elements
    from chipset.planner.run import from_run_config

    cfg = resolve_config(None, [*BASE, "islands.count=2", f"islands.sync_every={H}"], world_size=2)
    m, lay, _ = from_run_config(cfg, 1)
    handed, _ = outer_step_bytes(owned_elements(m, lay)["only"], "fp32", 2)
    assert _summary(runs["diloco"])["cross_island_bytes"] == (STEPS // H) * 2 * handed


@pytest.mark.multirank
def test_fedavg_with_h1_is_dp(runs):
    dp, fed = _losses(runs["dp"]), _island_losses(runs["fedavg"])
    assert len(dp) == len(fed) == STEPS
    worst = max(abs(a - b) for a, b in zip(dp, fed, strict=True))
    assert worst <= TOL, (worst, TOL, dp[-3:], fed[-3:])
    assert _summary(runs["fedavg"])["same_parameters"]


@pytest.mark.multirank
def test_mixed_backend_islands_match_one_backend(runs):
    if "mixed" not in runs:
        pytest.skip("the cpu backend is not available here")
    s = _summary(runs["mixed"])
    assert [p["backend"] for p in s["per_island"]] == ["cpu", "cpu_sim"]
    fed, mixed = _island_losses(runs["fedavg"]), _island_losses(runs["mixed"])
    worst = max(abs(a - b) for a, b in zip(fed, mixed, strict=True))
    assert worst <= TOL, (worst, TOL)
    assert s["same_parameters"]


@pytest.mark.multirank
def test_outer_state_survives_a_resume(runs, tmp_path):
    """Resumed from step 24 (between the outer steps at 16 and 32: global parameters apart from
    the masters, outer momentum non-zero), the job ends on the same parameters."""
    run = tmp_path / "resumed"
    shutil.copytree(runs["diloco"], run)
    for i in (0, 1):
        d = run / f"island-{i}"
        for c in (d / "checkpoints").glob(f"step-{STEPS:08d}"):
            shutil.rmtree(c)
        (d / "summary.json").unlink()
    (run / "summary.json").unlink()
    r = chipset_train(run, 2, [*BASE, "islands.count=2", f"islands.sync_every={H}",
                               f"train.checkpoint_every={STEPS - 8}"], env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed" in (r.stdout + r.stderr).lower()
    before = {p["params_digest"] for p in _summary(runs["diloco"])["per_island"]}
    after = {p["params_digest"] for p in _summary(run)["per_island"]}
    assert len(before) == 1 and after == before


@pytest.mark.parametrize("sets, says", [
    (["islands.count=3"], "must divide the world size"),
    (["islands.count=2", "islands.sync_every=0"], "islands.sync_every = 0"),
    (["islands.count=2", 'islands.outer_optimizer="adam"'], "expected one of nesterov, sgd"),
    (["islands.count=2", 'islands.pseudo_grad_dtype="fp8"'], "expected one of fp32, bf16, int8"),
    (["islands.count=2", 'islands.backends="cpu_sim"'], "name one per island"),
])
def test_bad_islands_config_is_refused(sets, says):
    with pytest.raises(ConfigError, match=says):
        resolve_config(None, [*BASE, *sets], world_size=2)


def test_bad_islands_config_exits_2_before_launch(tmp_path):
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--run-dir",
                        str(tmp_path / "run"), "--set", "islands.count=2", "--set", "islands.sync_every=0"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "islands.sync_every = 0" in r.stderr and not (tmp_path / "run").exists()


def test_int8_pseudo_gradients_round_to_half_a_step_of_their_block_scale():
    """The int8 wire format: one float32 scale per INT8_BLOCK elements (the block's largest
    magnitude / 127), every element within half a step of it; what it drops is what error
    feedback carries to the next outer step."""
    from chipset.train.islands.outer import INT8_BLOCK, dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * INT8_BLOCK + 5, generator=g) * torch.logspace(-3, 1, 2 * INT8_BLOCK + 5)
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.numel() == 3
    back = dequantize_int8(codes, scale)
    step = scale.repeat_interleave(INT8_BLOCK)[:x.numel()]
    assert torch.all((x - back).abs() <= step / 2 * (1 + 4 * torch.finfo(torch.float32).eps))
    assert torch.allclose(back.abs()[:INT8_BLOCK].max(), x.abs()[:INT8_BLOCK].max(), rtol=2 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.multirank
def test_a_killed_island_rejoins_while_the_other_keeps_stepping(tmp_path):
    """Island 1's only rank is killed as it starts step 10 (cpu_sim's fault injection); its
    launcher restarts it. Island 0 runs steps 10 to 12 alone, and at the outer step after step
    12 the restarted island takes part with zeros, receives the global state (parameters, outer
    momentum, inner optimizer state, step counts) and trains on to the end: both end on the same
    parameters after the same outer steps. What island 1 computed between step 8 (its last outer
    step) and its death is what is lost, by design."""
    steps, h = 24, 4
    env = _env(CHIPSET_BACKEND="cpu_sim", CHIPSET_SIM_FAULTS="kill:rank=0,step=9,island=1",
               CHIPSET_SIM_FAULT_DIR=str(tmp_path / "faults"))
    env.pop("CHIPSET_DISABLE_PLUGINS", None)
    run = tmp_path / "run"
    sets = [*(x for x in BASE if not x.startswith("train.steps=")), f"train.steps={steps}", "islands.count=2", f"islands.sync_every={h}", "islands.quorum_timeout=300"]
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--max-restarts", "1",
                        "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fault injected (kill:rank=0,step=9,island=1)" in r.stderr
    s = _summary(run)
    assert [p["restarts"] for p in s["per_island"]] == [0, 1]
    assert [p["outer_steps"] for p in s["per_island"]] == [steps // h] * 2
    assert s["same_parameters"], s
    steps_of = [[json.loads(x)["step"] for x in (run / f"island-{i}" / "metrics.jsonl").read_text().splitlines()]
                for i in (0, 1)]
    assert steps_of[0] == list(range(1, steps + 1))  # island 0 never stopped
    assert steps_of[1] == [*range(1, 10), *range(13, steps + 1)]  # island 1: dead for steps 10 to 12
    q0 = {q["step"]: q for q in _summary(run / "island-0")["islands"]["quorums"]}
    assert q0[12]["members"] == [0, 1] and q0[12]["joiners"] == [1]
    assert all(q0[t]["joiners"] == [] and q0[t]["members"] == [0, 1] for t in (4, 8, 16, 20, 24))
