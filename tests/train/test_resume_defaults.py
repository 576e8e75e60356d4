"""Runs are not lost by default: checkpoints on, a bare ``--resume``, a finished run recognised.

Before: ``train.checkpoint_every`` defaulted to 0, so a crashed run of the default config had
nothing to resume from; ``--resume`` without a value was a usage error; and rerunning the
command of a run finished without checkpoints trained it again from step 0, rewriting its
summary.json and metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forked_cli
from chipset.train import rundir
from chipset.train.checkpoint import store
from chipset.train.checkpoint.manager import Checkpointer
from chipset.train.config import TrainConfig

SMALL = ["--set", "train.steps=3", "--set", "train.global_batch=4"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != rundir.LOCK and "tensorboard" not in p.parts}


def test_checkpoint_every_defaults_to_500_steps_and_saves_after_the_last_step():
    assert TrainConfig().checkpoint_every == 500
    ck = Checkpointer.__new__(Checkpointer)  # due() reads only the interval and the run's length
    ck.every, ck.cfg = 500, type("C", (), {"train": TrainConfig(steps=1200)})()
    assert [s for s in range(1, 1201) if ck.due(s)] == [500, 1000, 1200]
    ck.every = 0
    assert not any(ck.due(s) for s in range(1, 1201))  # 0 still means never, not even at the end


def test_default_run_checkpoints_its_last_step_then_bare_resume_reports_it_finished_or_continues(tmp_path):
    run = tmp_path / "run"
    r = _cli(*SMALL, "--run-dir", str(run))  # no checkpoint setting at all
    assert r.returncode == 0, r.stderr[-3000:]
    cks = store.list_checkpoints(run)
    assert [c.step for c in cks] == [3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoints_saved"] == [3] and summary["run_id"] == rundir.read_run_id(run)

    # The same command again, with a bare --resume (= auto): nothing trained, nothing rewritten.
    before = _snapshot(run)
    r = _cli(*SMALL, "--run-dir", str(run), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"run in {run} already finished at step 3; raise train.steps to continue, or use a new --run-dir"
            in r.stdout), r.stdout
    assert "chipset checkpoint: saved" not in r.stdout and "Traceback" not in r.stderr
    assert _snapshot(run) == before

    # Raising train.steps continues from the final checkpoint (bare --resume before another option).
    r = _cli("--resume", "--set", "train.steps=5", "--set", "train.global_batch=4", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {cks[0].path} (step 3)" in r.stdout
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert [c.step for c in store.list_checkpoints(run)] == [5, 3]


def test_a_run_finished_without_checkpoints_is_recognised_from_its_summary(tmp_path):
    run = tmp_path / "run"
    r = _cli(*SMALL, "--set", "train.checkpoint_every=0", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / store.CHECKPOINTS).exists()  # 0 = never
    before = _snapshot(run)
    r = _cli(*SMALL, "--set", "train.checkpoint_every=0", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run in {run} already finished at step 3" in r.stdout, r.stdout
    assert _snapshot(run) == before  # before: trained again from step 0 and rewrote both files
    # --resume none still starts a new run there (no checkpoints of the old run to refuse over).
    r = _cli(*SMALL, "--set", "train.checkpoint_every=0", "--resume", "none", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already finished" not in r.stdout
    assert json.loads((run / "summary.json").read_text())["run_id"] != json.loads(before["summary.json"])["run_id"]


def test_bare_resume_followed_by_a_config_file_says_to_put_the_config_first(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text("[train]\nsteps = 2\n")
    r = _cli("--resume", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "that is a config file, not a checkpoint" in r.stderr
    assert f"chipset train {cfg} --resume" in r.stderr
    assert not (tmp_path / "run").exists()
