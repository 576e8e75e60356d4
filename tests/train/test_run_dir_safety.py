"""A run directory belongs to one run: lock, run id, config compatibility, atomic strict-JSON outputs.

Each test reproduces a failure seen before the fix (issue 14, "Data loss and wrong
results"): two ``chipset train`` on one run directory both ran; an older run's
checkpoints took over a new run and pruning deleted the new run's; a changed
``rope_theta``/heads/seed resumed silently; rerunning a finished command rewrote
summary.json with a degenerate one; a torn metrics.jsonl line broke every resume; a full
disk said nothing about space and could leave a 0-byte summary.json; a manifest listing
no files verified; a diverged run wrote NaN tokens and never stopped.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked_cli
from chipset.train import rundir
from chipset.train.checkpoint import store
from chipset.train.resume_check import config_differences

BASE = ["--set", "train.steps=4", "--set", "train.global_batch=4", "--set", "train.checkpoint_every=2"]


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *args], capture_output=True,
                          text=True, env=_env(), timeout=timeout)


def _strict(text: str):
    """json.loads that refuses NaN/Infinity tokens (what a strict parser does)."""
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    return json.loads(text, parse_constant=refuse)


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != rundir.LOCK and "tensorboard" not in p.parts}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by the tests that change it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = _cli(*BASE, "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _copy(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


# --- 1. the lock ------------------------------------------------------------------------------
def test_a_second_train_on_a_locked_run_dir_exits_2_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "chipset.cli.main", "train", "--set", "train.steps=100000",
                              "--set", "train.checkpoint_every=0", "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size:
                break  # the first job is training
            time.sleep(0.2)
        assert first.poll() is None, first.stdout.read()[-3000:]
        before = (run / "config.toml").read_bytes()
        second = _cli("--set", "train.steps=3", "--set", "train.seed=7", "--run-dir", str(run))
        assert second.returncode == 2, second.stdout + second.stderr
        assert "is in use by another job" in second.stderr
        assert f"pid {first.pid}" in second.stderr and "started" in second.stderr
        assert "Traceback" not in second.stderr
        assert (run / "config.toml").read_bytes() == before  # the second job wrote nothing
        assert first.poll() is None  # and the first one goes on
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # The lock died with its holder: the directory is usable again.
    r = _cli("--set", "train.steps=1", "--resume", "none", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]


def test_lock_unit_exclusive_and_shared(tmp_path):
    with rundir.RunLock(tmp_path):
        with pytest.raises(rundir.RunDirLocked, match=f"pid {os.getpid()}"):
            rundir.RunLock(tmp_path).acquire()
    with rundir.RunLock(tmp_path, shared=True), rundir.RunLock(tmp_path, shared=True):
        with pytest.raises(rundir.RunDirLocked):  # the nodes of one job share; a single-node job may not
            rundir.RunLock(tmp_path).acquire()


# --- 2. run ids -------------------------------------------------------------------------------
def _fake(run: Path, step: int, run_id: str | None) -> None:
    tmp = run / "checkpoints" / f".tmp-step-{step:08d}"
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text("{}")
    store.commit(tmp, store.checkpoint_dir(run, step), step, store.hash_files(tmp, ["state.json"]),
                 {"run_id": run_id} if run_id else {})


def test_older_runs_checkpoints_neither_take_over_nor_make_pruning_delete_the_new_runs(tmp_path):
    for s in (10, 20, 30):
        _fake(tmp_path, s, "old")
    _fake(tmp_path, 2, "new")
    _fake(tmp_path, 4, "new")
    # Before run ids: select() chose old step 30 and prune(keep=2) deleted the new run's steps 2 and 4.
    chosen, _ = store.select(tmp_path, "new")
    assert chosen.step == 4
    assert store.select(tmp_path, "none-of-these") == (None, [])
    removed = store.prune(tmp_path, 1, "new")
    assert [p.name for p in removed] == ["step-00000002"]
    assert [c.step for c in store.list_checkpoints(tmp_path)] == [30, 20, 10, 4]


def test_resume_none_over_another_runs_checkpoints_is_refused_unless_discarded(finished, tmp_path):
    run = _copy(finished, tmp_path)
    old_id = rundir.read_run_id(run)
    assert old_id and all(store.run_id_of(c.path) == old_id for c in store.list_checkpoints(run))
    before = _snapshot(run)
    r = _cli(*BASE, "--resume", "none", "--run-dir", str(run))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"holds 2 checkpoint(s) of another run (run {old_id}; steps 2, 4)" in r.stderr
    assert "--discard-checkpoints" in r.stderr
    assert _snapshot(run) == before
    r = _cli(*BASE, "--set", "train.checkpoint_every=3", "--resume", "none", "--discard-checkpoints",
             "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    new_id = rundir.read_run_id(run)
    assert new_id != old_id
    cks = store.list_checkpoints(run)
    assert [c.step for c in cks] == [4, 3]  # every 3 steps and after the last one
    assert {store.run_id_of(c.path) for c in cks} == {new_id}
    state = json.loads((cks[0].path / store.STATE).read_text())
    assert state["run_id"] == new_id


# --- 3. config compatibility on resume ------------------------------------------------------------
@pytest.mark.parametrize("change, line", [
    ("model.num_attention_heads=2", "model.num_attention_heads: 4 -> 2"),  # same parameter shapes
    ("model.rope_theta=500.0", "model.rope_theta: 10000.0 -> 500.0"),
    ("train.seed=99", "train.seed: 1234 -> 99"),
    ("data.seed=5", "data.seed: 0 -> 5"),
])
def test_resume_with_an_incompatible_config_change_exits_2_listing_it(finished, tmp_path, change, line):
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    r = _cli(*BASE, "--set", "train.steps=6", "--set", change, "--run-dir", str(run))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "written under a different config" in r.stderr and line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert _snapshot(run) == before


def test_resume_allows_the_documented_safe_changes(finished, tmp_path):
    run = _copy(finished, tmp_path)
    r = _cli(*BASE, "--set", "train.steps=6", "--set", "train.lr=0.005", "--set", "train.warmup_steps=2",
             "--set", "train.keep_checkpoints=0", "--set", "train.log_every=2", "--set", "parallel.micro_batches=2",
             "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "(step 4)" in r.stdout


def test_config_differences_unit():
    saved = {"model": {"rope_theta": 1e4, "vocab_size": 64}, "train": {"steps": 4, "seed": 1, "lr": 0.1},
             "parallel": {"tp": 1}}
    new = {"model": {"rope_theta": 1e4, "vocab_size": 64, "added_later": 3},
           "train": {"steps": 9, "seed": 2, "lr": 0.2}, "parallel": {"tp": 2}}
    assert config_differences(saved, new) == ["train.seed: 1 -> 2"]


# --- 4. atomic, strict outputs; a finished run; a torn metrics tail; a full disk ----------------
def test_rerunning_a_finished_command_keeps_its_summary(finished, tmp_path):
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    r = _cli(*BASE, "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run in {run} already finished at step 4" in r.stdout and "Traceback" not in r.stderr
    after = _snapshot(run)
    assert after["summary.json"] == before["summary.json"]
    assert after["metrics.jsonl"] == before["metrics.jsonl"]
    assert _strict(after["summary.json"].decode())["final_loss"] is not None


def test_a_torn_metrics_tail_is_dropped_with_a_warning_on_resume(finished, tmp_path):
    run = _copy(finished, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.1, "grad_')  # a crash mid-write
    r = _cli(*BASE, "--set", "train.steps=6", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    # The note is a library warning: it goes through logging, to stderr.
    assert "dropped" in r.stderr and "line 5" in r.stderr, r.stderr[-3000:]
    steps = [_strict(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


_ENOSPC_DRIVER = """
import errno, os, sys
real = os.fsync
def fsync(fd):
    if sys.argv[1] in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(fd)
os.fsync = fsync
from chipset._process import exit_process
from chipset.cli.main import main
exit_process(main(sys.argv[2:]))  # the `chipset` command's own ending (chipset.cli.main.entry)
"""


@pytest.mark.parametrize("where, extra", [("checkpoints", []), ("checkpoints", ["train.async_checkpoint=true"]),
                                          ("summary.json", [])])
def test_a_full_disk_says_no_space_left_and_leaves_no_empty_summary(tmp_path, where, extra):
    # ENOSPC injected where the real write path reaches the disk (fsync of the named files):
    # a filesystem that fills up cannot be mounted on every test machine.
    run = tmp_path / "run"
    sets = [a for e in extra for a in ("--set", e)]
    r = forked_cli.run([sys.executable, "-c", _ENOSPC_DRIVER, where, "train", *BASE, *sets, "--run-dir", str(run)],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no space left on device while writing" in r.stderr and "MiB free" in r.stderr, r.stderr
    assert str(run) in r.stderr
    assert not (run / "summary.json").exists()
    assert not list(run.glob(".summary.json.tmp-*"))


def test_atomic_write_keeps_the_old_content_on_enospc(tmp_path, monkeypatch):
    f = tmp_path / "summary.json"
    f.write_text('{"final_loss": 1.0}\n')

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir.os, "fsync", full)
    with pytest.raises(rundir.DiskFullError, match="no space left on device while writing .*summary.json"):
        rundir.atomic_write_text(f, '{"final_loss": 2.0}\n')
    monkeypatch.undo()
    assert f.read_text() == '{"final_loss": 1.0}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# --- 5. manifests -------------------------------------------------------------------------------
def test_a_manifest_listing_no_files_fails_verification(tmp_path):
    _fake(tmp_path, 2, "r")
    tmp = tmp_path / "checkpoints" / ".tmp-step-00000004"
    tmp.mkdir()
    store.commit(tmp, store.checkpoint_dir(tmp_path, 4), 4, {}, {"run_id": "r"})
    why = store.verify(store.checkpoint_dir(tmp_path, 4))
    assert why is not None and "lists no files" in why
    chosen, skipped = store.select(tmp_path, "r")
    assert chosen.step == 2 and skipped[0][0].name == "step-00000004"


# --- 6. non-finite losses -------------------------------------------------------------------------
def test_a_diverged_run_stops_after_max_nonfinite_steps_with_strict_json(tmp_path):
    run = tmp_path / "run"
    # lr 1e30: the first update throws the parameters to ~1e30, every later loss is NaN.
    r = _cli("--set", "train.steps=50", "--set", "train.global_batch=4", "--set", "train.lr=1e30",
             "--set", "train.max_nonfinite_steps=3", "--run-dir", str(run))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "for 3 consecutive steps (steps 2-4" in r.stderr and "train.max_nonfinite_steps = 3" in r.stderr
    assert "Traceback" not in r.stderr
    recs = [_strict(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    assert recs[-1]["loss"] is None and recs[-1]["skipped"] is True


def test_summary_of_a_run_ending_on_nan_is_strict_json(tmp_path):
    run = tmp_path / "run"
    r = _cli("--set", "train.steps=3", "--set", "train.global_batch=4", "--set", "train.lr=1e30",
             "--set", "train.max_nonfinite_steps=0", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    s = _strict((run / "summary.json").read_text())
    assert s["final_loss"] is None and "final_loss=nan" in s["nonfinite_values"]
