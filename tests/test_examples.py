"""Every config in examples/ is valid, and the ones sized for a laptop train (scaled down)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chipset.config import load_config
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
}


def test_examples_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "moe-tiny.toml", "long-context.toml", "llama-1b.toml", "resnet-tiny.toml"} <= names


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
