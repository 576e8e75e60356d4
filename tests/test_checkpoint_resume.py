"""Saving, resuming and refusing checkpoints through ``chipset train`` in one process (cpu_sim).

A run killed mid-way (``CHIPSET_SIM_FAULTS=kill``) and started again with the default
``--resume auto`` ends with the uninterrupted run's params_digest bit for bit; a
truncated newest checkpoint is reported and the previous one used; a different model
shape and a bad ``--resume`` path are refused before anything is written (exit 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import testenv

BASE = ["--set", "train.steps=6", "--set", "train.global_batch=4", "--set", "train.checkpoint_every=2"]


def _cli(*args: str, env_extra: dict | None = None):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "chipset.cli.main", "train", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    r = _cli(*BASE, "--set", "train.keep_checkpoints=0", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_killed_run_resumes_automatically_and_matches_bit_for_bit(reference, tmp_path):
    run = tmp_path / "run"
    r = _cli(*BASE, "--run-dir", str(run),
             env_extra={"CHIPSET_SIM_FAULTS": "kill:rank=0,step=5", "CHIPSET_SIM_FAULT_DIR": str(tmp_path / "f")})
    assert r.returncode != 0 and "fault injected" in r.stderr
    assert not (run / "summary.json").exists()
    r = _cli(*BASE, "--run-dir", str(run),  # same command again: --resume auto is the default
             env_extra={"CHIPSET_SIM_FAULTS": "kill:rank=0,step=5", "CHIPSET_SIM_FAULT_DIR": str(tmp_path / "f")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-00000004 (step 4)" in r.stdout
    s = _summary(run)
    assert s["params_digest"] == _summary(reference)["params_digest"]
    assert s["resumed_step"] == 4
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoints" / "step-00000006"
    shard = next(newest.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (run / "summary.json").unlink()
    r = _cli(*BASE, "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"skipping {newest}" in r.stdout and "truncated" in r.stdout
    assert "step-00000004 (step 4)" in r.stdout
    s = _summary(run)
    assert s["skipped_checkpoints"][0]["path"] == str(newest)
    assert s["params_digest"] == _summary(reference)["params_digest"]


def test_a_different_model_shape_is_refused_naming_the_parameters(reference, tmp_path):
    run = tmp_path / "run"
    r = _cli(*BASE, "--set", "model.intermediate_size=48", "--resume", str(reference), "--run-dir", str(run))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "different model shape" in r.stderr
    assert "layers.0.mlp" in r.stderr and "checkpoint (64, 32), this model (48, 32)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not run.exists()


def test_a_resume_path_without_a_checkpoint_is_refused_before_launch(tmp_path):
    run = tmp_path / "run"
    r = _cli(*BASE, "--resume", str(tmp_path / "nowhere"), "--run-dir", str(run))
    assert r.returncode == 2
    assert "--resume" in r.stderr and "no checkpoint there" in r.stderr
    assert not run.exists()
