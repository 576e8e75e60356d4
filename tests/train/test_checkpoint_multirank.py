"""Checkpoints across failures, on real torchrun jobs (cpu_sim, gloo).

One uninterrupted dp2 x tp2 (ZeRO 0, 4 ranks) run of 12 steps checkpointing every 4 steps
is the reference. A run whose rank 1 is killed at step 7 restarts through torch's elastic
agent, resumes from step 4 by itself and ends with the reference's params_digest bit for
bit, also when rank 1 is killed in the middle of an asynchronous save (that partial
checkpoint is never used); a never-arriving collective ends the job non-zero within
timeout + 30 s naming the missing rank. Resuming under other layouts:
tests/train/test_checkpoint_layouts.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import forked_cli
import testenv
from testenv import SideBySide, selected

HERE = Path(__file__).resolve()
STEPS = 12
NPROC = "4"
MODEL = ["--set", "parallel.tp=2", "--set", "model.num_key_value_heads=2", "--set", "train.global_batch=8", "--set", "train.seed=7",
         "--set", "parallel.bucket_mb=0.02", "--set", "train.grad_clip=0.5"]


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 420):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _metrics(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows}


HANG_TIMEOUT_S = 5


def _reference(run: Path):
    return _cli("--nproc", NPROC, *MODEL, "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=4",
                "--set", "train.keep_checkpoints=0", "--run-dir", str(run))


def _elastic(run: Path):
    # Synchronous saves: when rank 1 dies at step 7 the step-4 checkpoint is committed for certain.
    # (A kill inside an asynchronous save is _async_kill.)
    return _cli("--nproc", NPROC, *MODEL, "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=4",
                "--max-restarts", "1", "--run-dir", str(run),
                env_extra={"CHIPSET_SIM_FAULTS": "kill:rank=1,step=7", "CHIPSET_SIM_FAULT_DIR": str(run.parent / "faults")})


def _hang(run: Path):
    r = _cli("--nproc", "2", "--set", "train.steps=30", "--run-dir", str(run),
             env_extra={"CHIPSET_SIM_FAULTS": "hang:rank=1,collective=25",
                        "CHIPSET_COLLECTIVE_TIMEOUT": str(HANG_TIMEOUT_S)})
    return r, time.time()


def _async_kill(run: Path):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                           "--max-restarts=1", str(HERE), str(run)], capture_output=True, text=True, env=env, timeout=420)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's jobs for the tests this session runs, side by side (testenv.SideBySide):
    {"ref": ..., test name: (what its job returned, run directory)}. The hang test's job mostly
    waits (on the collective timeout), so it overlaps the others for free."""
    job_of = {test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run_bit_for_bit: _elastic,
              test_a_collective_that_never_arrives_ends_the_job_and_names_the_missing_rank: _hang,
              test_a_rank_killed_during_an_asynchronous_save_leaves_no_usable_partial: _async_kill}
    root = tmp_path_factory.mktemp("ckpt")

    def start(key, job):
        (root / key).mkdir()
        return lambda: (job(root / key / "run"), root / key / "run")

    wanted = {test.__name__: job for test, job in job_of.items() if selected(request, test)}
    jobs = {name: start(name[5:25], job) for name, job in wanted.items() if job is _hang}  # first: it waits most
    if set(wanted) - set(jobs):
        jobs["ref"] = start("ref", _reference)
    jobs.update({name: start(name[5:25], job) for name, job in wanted.items() if name not in jobs})
    started = SideBySide(jobs)
    yield started
    started.close()


def _ref(runs) -> Path:
    r, run = runs["ref"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


@pytest.mark.multirank
def test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run_bit_for_bit(runs):
    reference = _ref(runs)
    r, run = runs["test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run_bit_for_bit"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fault injected (kill:rank=1,step=7)" in r.stderr
    summary = json.loads((run / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert summary["restarts"] == 1
    assert summary["resumed_step"] == 4 and summary["resumed_from"].endswith("step-00000004")
    assert summary["params_digest"] == ref["params_digest"]
    losses = _metrics(run)
    assert sorted(losses) == list(range(1, STEPS + 1))  # the replayed steps 5-7 are not duplicated
    assert losses == pytest.approx(_metrics(reference), rel=0, abs=0)


@pytest.mark.multirank
def test_a_collective_that_never_arrives_ends_the_job_and_names_the_missing_rank(runs):
    (r, ended), run = runs["test_a_collective_that_never_arrives_ends_the_job_and_names_the_missing_rank"]
    assert r.returncode != 0
    log0 = json.loads((run / "hangs" / "rank0.json").read_text())
    assert log0["timeout"] and log0["recent_ops"]
    stuck = [e for e in log0["recent_ops"] if e["state"] != "done"][-1]
    assert {"op", "group", "seq", "bytes", "time"} <= set(stuck)
    assert ended - stuck["time"] < HANG_TIMEOUT_S + 30  # hang guard: the job ended soon after the stall
    assert "rank(s) that did not arrive: 1" in r.stdout, r.stdout[-3000:]
    report = json.loads((run / "hangs" / "report.json").read_text())
    assert [m["rank"] for m in report["collectives"][0]["missing"]] == [1]
    assert report["collectives"][0]["waiting"] == [0]


@pytest.mark.multirank
def test_a_rank_killed_during_an_asynchronous_save_leaves_no_usable_partial(runs):
    reference = _ref(runs)
    r, run = runs["test_a_rank_killed_during_an_asynchronous_save_leaves_no_usable_partial"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank 1 killed inside the asynchronous save of step 8" in r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1
    assert summary["resumed_step"] == 4  # not the interrupted step-8 save
    assert summary["params_digest"] == json.loads((reference / "summary.json").read_text())["params_digest"]
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["step-00000004", "step-00000008", "step-00000012"]  # step 8 rewritten after the restart


def _async_kill_job(run_dir: str) -> None:
    """torchrun script: like the elastic test, but rank 1 dies inside its first step-8 save."""
    import signal

    from chipset.loader import backend
    from chipset.train import train
    from chipset.train.checkpoint import manager
    from chipset.train.config import load_config

    overrides = [MODEL[i + 1] for i in range(0, len(MODEL), 2)]
    overrides += [f"train.steps={STEPS}", "train.checkpoint_every=4", "train.async_checkpoint=true",
                  "train.keep_checkpoints=0"]
    cfg = load_config(None, overrides)
    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    cfg.validate(world_size=b.collective.world_size())
    write = manager.Checkpointer._write

    def dying_write(self, *args):
        tmp, _, step = args[-3:]  # (..., tmp, final, step): what is staged before them is not this test's
        if step == 8 and self.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "__1_0.distcp").write_bytes(b"partial")
            print("rank 1 killed inside the asynchronous save of step 8", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, *args)

    manager.Checkpointer._write = dying_write
    try:
        train(cfg, b, run_dir, resume="auto")
    finally:
        b.collective.destroy()


if __name__ == "__main__":
    _async_kill_job(sys.argv[1])
