"""Every config in examples/ is valid, and the ones sized for a laptop train (scaled down)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import parity
from chipset.train.config import load_config
from testenv import SideBySide, clean_env, selected

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# hf-finetune.toml and lora-finetune.toml name a model directory the user supplies (tests/models/test_hf.py and
# tests/parallel/test_lora.py load them with one).
CONFIGS = sorted(p for p in EXAMPLES.glob("*.toml") if p.name not in ("hf-finetune.toml", "lora-finetune.toml"))

# Scaled down so the suite stays fast; the layout (the point of each example) is kept.
RUNNABLE = {
    "tiny.toml": ["train.steps=3"],
    "moe-tiny.toml": ["train.steps=3"],
    "long-context.toml": ["train.steps=2", "train.seq_len=256"],
    "resnet-tiny.toml": ["train.steps=3"],
    "gpt2-tiny.toml": ["train.steps=3"],
    "pipeline-zero-bubble.toml": ["train.steps=3", "model.hidden_size=64", "model.intermediate_size=176",
                                  "model.vocab_size=256"],
    "muon.toml": ["train.steps=3"],
    "islands-tiny.toml": ["train.steps=3"],
    "islands-overlap.toml": ["train.steps=5"],  # a delayed outer step at 4, the last (blocking) at 5
}


def test_examples_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "moe-tiny.toml", "long-context.toml", "llama-1b.toml", "resnet-tiny.toml",
            "gpt2-tiny.toml", "rl-addition.toml", "rl-sort.toml"} <= names


def test_rl_example_runs(tmp_path):
    """examples/rl-addition.toml with ``chipset rl``, two steps in one process (docs/rl.md)."""
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "rl", str(EXAMPLES / "rl-addition.toml"),
                        "--run-dir", str(tmp_path / "run"), "--set", "train.steps=2", "--set", "train.global_batch=16"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2] and "reward/addition_mean" in recs[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_is_valid(path):
    cfg = load_config(path, [])
    assert cfg.train.steps > 0


def _example(name: str, run_dir: Path) -> subprocess.CompletedProcess:
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    sets = [a for kv in RUNNABLE[name] for a in ("--set", kv)]
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", str(EXAMPLES / name),
                           "--nproc", "2", "--run-dir", str(run_dir), *sets],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_example_trains_on_two_ranks(runs, name):
    r, run_dir = runs[name]
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = int(RUNNABLE[name][0].split("=")[1])
    assert summary["steps"] == steps, summary


# --- examples/custom_loop.py: the engine as a library (docs/library.md) -------------------

# Its model: Linear(16, 64) -> GELU -> Linear(64, 8) on a global batch of 16. Longest reduction:
# the 64 hidden features summed by the second Linear; longest chain, forward: two matmuls,
# log-sum-exp, batch mean (4), backward the same, plus the weight-gradient sums (+1).
LOOP_N, LOOP_DEPTH, LOOP_STEPS = 64, 2 * 4 + 1, 8


def _custom_loop(cwd: Path, nproc: int, *sets: str) -> list[float]:
    """Run the script (one plain process, or torchrun with ``nproc`` ranks) in ``cwd``; the losses
    rank 0 printed. Printed with 9 significant digits, which identify a float32 exactly."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
              if nproc > 1 else [sys.executable])
    r = forked_cli.run([*launch, str(EXAMPLES / "custom_loop.py"), *sets], cwd=cwd, capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("step ")]
    return [float(torch.tensor(float(ln[3]), dtype=torch.float32)) for ln in lines]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The jobs of this file's multi-rank tests that this session runs, side by side
    (testenv.SideBySide): each example's run {name: (CompletedProcess, run directory)}, and
    the custom loop's losses {"loop-ref" (one process), "loop-zero3", "loop-tp2": losses}."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {}
    loops = {"loop-zero3": test_custom_loop_zero3_on_two_ranks_matches_one_process_and_resumes,
             "loop-tp2": test_custom_loop_tp2_with_its_plan_matches_one_process}
    loops = {k: t for k, t in loops.items() if selected(request, t)}
    if loops:
        jobs["loop-ref"] = lambda: _custom_loop(root / "loop-ref", 1)
    if "loop-zero3" in loops:
        # ZeRO-3 over 2 ranks, stopped after 4 steps (its checkpoint), then resumed to the end.
        def zero3():
            cwd = root / "loop-zero3"
            first = _custom_loop(cwd, 2, "train.steps=4")
            saved = (cwd / "runs" / "custom-loop" / "checkpoints" / "step-00000004").is_dir()
            return first, saved, _custom_loop(cwd, 2)

        jobs["loop-zero3"] = zero3
    if "loop-tp2" in loops:
        jobs["loop-tp2"] = lambda: _custom_loop(root / "loop-tp2", 2, "parallel.tp=2", "parallel.zero=0")
    for name in selected(request, test_example_trains_on_two_ranks):
        jobs[name] = (lambda n: lambda: (_example(n, root / n), root / n))(name)
    started = SideBySide(jobs)
    yield started
    started.close()


def _loop_reference(runs) -> list[float]:
    losses = runs["loop-ref"]
    assert len(losses) == LOOP_STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # it trains
    return losses


@pytest.mark.multirank
def test_custom_loop_zero3_on_two_ranks_matches_one_process_and_resumes(runs):
    # ZeRO-3 over 2 ranks, stopped after 4 steps (its checkpoint), then resumed to the end.
    first, saved, rest = runs["loop-zero3"]
    assert saved
    assert len(first) == 4 and len(rest) == LOOP_STEPS - 4
    parity.assert_losses_close(first + rest, _loop_reference(runs), n=LOOP_N, depth=LOOP_DEPTH)


@pytest.mark.multirank
def test_custom_loop_tp2_with_its_plan_matches_one_process(runs):
    parity.assert_losses_close(runs["loop-tp2"], _loop_reference(runs), n=LOOP_N, depth=LOOP_DEPTH)


def test_library_page_shows_the_custom_loop_as_it_is():
    """docs/library.md's 30-line loop is examples/custom_loop.py (less its docstring), the file the
    tests above run: the page cannot drift from a script that works."""
    page = (EXAMPLES.parent / "docs" / "library.md").read_text()
    code = (EXAMPLES / "custom_loop.py").read_text().split('"""', 2)[2].lstrip("\n")
    assert "```python skip-example" in page and code in page
    assert len(code.splitlines()) <= 32
