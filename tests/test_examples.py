"""Every config in examples/ is valid, and the ones sized for a laptop train (scaled down)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parity
from chipset.train.config import load_config
from testenv import clean_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# hf-finetune.toml names a model directory the user supplies (tests/test_hf.py runs it with one).
CONFIGS = sorted(p for p in EXAMPLES.glob("*.toml") if p.name != "hf-finetune.toml")

# Scaled down so the suite stays fast; the layout (the point of each example) is kept.
RUNNABLE = {
    "tiny.toml": ["train.steps=3"],
    "moe-tiny.toml": ["train.steps=3"],
    "long-context.toml": ["train.steps=2", "train.seq_len=256"],
    "resnet-tiny.toml": ["train.steps=3"],
    "gpt2-tiny.toml": ["train.steps=3"],
}


def test_examples_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "moe-tiny.toml", "long-context.toml", "llama-1b.toml", "resnet-tiny.toml",
            "gpt2-tiny.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_is_valid(path):
    cfg = load_config(path, [])
    assert cfg.train.steps > 0


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_example_trains_on_two_ranks(tmp_path, name):
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    sets = [a for kv in RUNNABLE[name] for a in ("--set", kv)]
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "chipset.cli.main", "train", str(EXAMPLES / name),
                        "--nproc", "2", "--run-dir", str(run_dir), *sets],
                       capture_output=True, text=True, env=env, timeout=600)
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
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
              if nproc > 1 else [sys.executable])
    r = subprocess.run([*launch, str(EXAMPLES / "custom_loop.py"), *sets], cwd=cwd, capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("step ")]
    return [float(torch.tensor(float(ln[3]), dtype=torch.float32)) for ln in lines]


@pytest.fixture(scope="module")
def loop_reference(tmp_path_factory):
    losses = _custom_loop(tmp_path_factory.mktemp("loop-ref"), 1)
    assert len(losses) == LOOP_STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # it trains
    return losses


@pytest.mark.multirank
def test_custom_loop_zero3_on_two_ranks_matches_one_process_and_resumes(tmp_path, loop_reference):
    # ZeRO-3 over 2 ranks, stopped after 4 steps (its checkpoint), then resumed to the end.
    first = _custom_loop(tmp_path, 2, "train.steps=4")
    assert (tmp_path / "runs" / "custom-loop" / "checkpoints" / "step-00000004").is_dir()
    rest = _custom_loop(tmp_path, 2)
    assert len(first) == 4 and len(rest) == LOOP_STEPS - 4
    parity.assert_losses_close(first + rest, loop_reference, n=LOOP_N, depth=LOOP_DEPTH)


@pytest.mark.multirank
def test_custom_loop_tp2_with_its_plan_matches_one_process(tmp_path, loop_reference):
    losses = _custom_loop(tmp_path, 2, "parallel.tp=2", "parallel.zero=0")
    parity.assert_losses_close(losses, loop_reference, n=LOOP_N, depth=LOOP_DEPTH)


def test_library_page_shows_the_custom_loop_as_it_is():
    """docs/library.md's 30-line loop is examples/custom_loop.py (less its docstring), the file the
    tests above run: the page cannot drift from a script that works."""
    page = (EXAMPLES.parent / "docs" / "library.md").read_text()
    code = (EXAMPLES / "custom_loop.py").read_text().split('"""', 2)[2].lstrip("\n")
    assert "```python skip-example" in page and code in page
    assert len(code.splitlines()) <= 32
