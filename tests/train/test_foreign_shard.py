"""A checkpoint shard from another save is refused with chipset's own message (exit 2).

Reproduces issue 14 (Security): a shard of another layout/dtype, with the manifest
regenerated so it verifies, surfaced torch.load's UnpicklingError and its advice to
re-run with the unsafe loading mode, which would run code from the file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import forked_cli
import testenv
from chipset.train.checkpoint import store


def _train(run, *args: str) -> subprocess.CompletedProcess:
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", "train.checkpoint_every=1",
                           "--run-dir", str(run), *args], capture_output=True, text=True, env=env, timeout=600)


def test_a_shard_from_another_dtype_is_refused_without_torchs_advice(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, "--set", "train.steps=1").returncode == 0
    assert _train(b, "--set", "train.steps=1", "--set", "train.dtype=bfloat16").returncode == 0
    ca, cb = store.checkpoint_dir(a, 1), store.checkpoint_dir(b, 1)
    shards = sorted(p.name for p in ca.glob("*.distcp"))
    assert shards
    for name in shards:
        shutil.copy(cb / name, ca / name)
    manifest = json.loads((ca / store.MANIFEST).read_text())
    manifest["files"].update(store.hash_files(ca, shards))  # the swap passes verification
    (ca / store.MANIFEST).write_text(json.dumps(manifest))
    assert store.verify(ca) is None
    r = _train(a, "--set", "train.steps=2")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "weights_only" not in out and "Traceback" not in out, out[-3000:]
    assert f"checkpoint {ca}: shard file(s) {shards[0]}" in out
    assert "float32" in out and "--resume none" in out
    assert len((a / "metrics.jsonl").read_text().splitlines()) == 1  # nothing trained or written
