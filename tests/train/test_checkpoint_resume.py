"""Saving, resuming and refusing checkpoints through ``chipset train`` in one process (cpu_sim).

A run killed mid-way (``CHIPSET_SIM_FAULTS=kill``) and started again with the default
``--resume auto`` ends with the uninterrupted run's params_digest bit for bit; a
truncated newest checkpoint is reported and the previous one used; a different model
shape and a bad ``--resume`` path are refused before anything is written (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

import forked_cli
import testenv

BASE = ["--set", "train.steps=6", "--set", "train.global_batch=4", "--set", "train.checkpoint_every=2"]


def _cli(*args: str, env_extra: dict | None = None):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *args], capture_output=True,
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
    # a diagnostic, so through logging (stderr), not the run's stdout
    assert f"WARNING chipset.train.checkpoint.manager: skipping checkpoint {newest}" in r.stderr
    assert "truncated" in r.stderr
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


# --- a crafted .metadata must never run code (issue 14) -------------------------------------

def _global(module: str, name: str) -> bytes:
    """Protocol-4 STACK_GLOBAL: the unpickler resolves ``name`` as a dotted attribute path."""
    enc = [s.encode() for s in (module, name)]
    return b"".join(b"\x8c" + bytes([len(e)]) + e for e in enc) + b"\x93"


def _call(fn: bytes, arg: str) -> bytes:
    a = arg.encode()
    return b"\x80\x04" + fn + b"\x8c" + bytes([len(a)]) + a + b"\x85R."  # fn((arg,)) then STOP


def gadgets(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    code = f"__import__('os').system({cmd!r})"
    getattr_gadget = (b"\x80\x04" + _global("builtins", "getattr") + _global("builtins", "__import__")
                      + b"\x8c\x02os\x85R" + b"\x8c\x06system\x86R" + b"\x8c" + bytes([len(cmd)])
                      + cmd.encode() + b"\x85R.")
    return {
        "dotted os.system under the DCP metadata module":
            _call(_global("torch.distributed.checkpoint.metadata", "os.system"), cmd),
        "dotted os.system under the DCP filesystem module":
            _call(_global("torch.distributed.checkpoint.filesystem", "os.system"), cmd),
        "__reduce__ to os.system": _call(_global("os", "system"), cmd),
        "__reduce__ to subprocess": _call(_global("subprocess", "getoutput"), cmd),
        "builtins.getattr": getattr_gadget,
        "builtins.eval": _call(_global("builtins", "eval"), code),
    }


def _plant(run: Path, data: bytes) -> Path:
    """Put ``data`` as the newest checkpoint's .metadata and re-hash the manifest, as an attacker would."""
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    (newest / ".metadata").write_bytes(data)
    mf = newest / "manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    mf.write_text(json.dumps(manifest))
    return newest


def test_gadget_pickles_are_refused_by_the_metadata_reader(tmp_path):
    from chipset.train.checkpoint import store

    marker = tmp_path / "pwned"
    for what, data in gadgets(marker).items():
        (tmp_path / ".metadata").write_bytes(data)
        with pytest.raises(pickle.UnpicklingError, match="allow-list"):
            store.safe_reader(tmp_path).read_metadata()
        assert not marker.exists(), what
    # the gadgets do work when unpickled without the allow-list: the test detects the attack
    pickle.loads(gadgets(marker)["dotted os.system under the DCP metadata module"])
    assert marker.exists()


@pytest.mark.parametrize("what", ["dotted os.system under the DCP metadata module", "__reduce__ to os.system",
                                  "builtins.getattr"])
def test_a_crafted_checkpoint_is_refused_with_resume_path_and_runs_nothing(reference, tmp_path, what):
    src = tmp_path / "src"
    shutil.copytree(reference, src)
    marker = tmp_path / "pwned"
    ck = _plant(src, gadgets(marker)[what])
    run = tmp_path / "run"
    r = _cli(*BASE, "--resume", str(ck), "--run-dir", str(run))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "is refused" in r.stderr and "allow-list" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


def test_a_crafted_checkpoint_is_refused_with_resume_auto_and_runs_nothing(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "summary.json").unlink(missing_ok=True)
    marker = tmp_path / "pwned"
    _plant(run, gadgets(marker)["dotted os.system under the DCP filesystem module"])
    r = _cli(*BASE, "--set", "train.steps=8", "--run-dir", str(run))  # --resume auto (the default)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "is refused" in r.stderr and "os.system" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()
