"""``train.compile = true``: regional compilation equals eager, and is refused where a backend declares no compile backend.

The backends are chosen by what their descriptors declare (``compile_backend``), never by
name: the parity test runs on an available backend that declares one (the suite's own
backend when it does), the refusal test on one that declares none.

Tolerance: compiled blocks compute the same ops in fp32 with fused kernels, so they differ
from eager only in the order and blocking of reductions: tests/parity.py's per-step
trajectory bound for this model (the same bound the data-parallel parity tests use).
Slow the first time (the compile itself, about a minute on a loaded 2-core machine; later
runs hit torch's compile cache).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import forked_cli
import parity
from testenv import TEST_BACKEND, clean_env

CFG = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": 4, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 7},
}
N_REDUCE = parity.model_reduction_size(CFG)
DEPTH = parity.model_depth(CFG["model"]["num_hidden_layers"])


def _backends(monkeypatch, declares: bool) -> list[str]:
    """Available backends whose descriptor declares (or not) a compile backend; the suite's first.

    The suite disables the ``cpu`` plugin by default (tests/testenv.py); this test picks by
    capability among all installed backends, so it looks past that.
    """
    from chipset.discovery import discover

    monkeypatch.delenv("CHIPSET_DISABLE_PLUGINS", raising=False)
    names = []
    for rec in discover():
        if rec.ok and rec.descriptor is not None and rec.descriptor.probe()[0]:
            if (getattr(rec.descriptor, "compile_backend", None) is not None) == declares:
                names.append(rec.name)
    return sorted(names, key=lambda n: n != TEST_BACKEND)


def _train(tmp_path, backend: str, compile_: bool) -> subprocess.CompletedProcess:
    sets = [f"{sec}.{k}={v}" for sec, kv in CFG.items() for k, v in kv.items()]
    sets.append(f"train.compile={'true' if compile_ else 'false'}")
    cmd = [sys.executable, "-m", "chipset.cli.main", "train", "--run-dir", str(tmp_path)]
    for s in sets:
        cmd += ["--set", s]
    env = clean_env()
    env.pop("CHIPSET_DISABLE_PLUGINS", None)
    env.update(CHIPSET_BACKEND=backend, OMP_NUM_THREADS="1")
    return forked_cli.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def _metrics(run_dir) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def test_compiled_blocks_match_eager(tmp_path, monkeypatch):
    names = _backends(monkeypatch, declares=True)
    if not names:
        pytest.skip("no available backend declares a compile_backend")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("torch.compile's inductor needs a C++ compiler on PATH (c++ or g++)")
    backend = names[0]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for d, c in ((eager, False), (compiled, True)):
        r = _train(d, backend, c)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((compiled / "summary.json").read_text())
    assert summary["compile"] is not None and summary["backend"] == backend
    assert json.loads((eager / "summary.json").read_text())["compile"] is None
    want_loss, want_norm = _metrics(eager)
    got_loss, got_norm = _metrics(compiled)
    assert len(got_loss) == CFG["train"]["steps"]
    parity.assert_losses_close(got_loss, want_loss, n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(got_norm, want_norm, n=N_REDUCE, depth=DEPTH)


def test_compile_refused_before_launch_without_a_compile_backend(tmp_path, monkeypatch):
    names = _backends(monkeypatch, declares=False)
    if not names:
        pytest.skip("every available backend declares a compile_backend")
    run_dir = tmp_path / "run"
    r = _train(run_dir, names[0], True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train.compile = true" in r.stderr and "compile_backend" in r.stderr
    assert not run_dir.exists(), "a refused run must leave nothing behind"


def test_compiled_frames_counts_each_compile_and_recompile():
    """What metrics.jsonl's ``compiles`` reads: one frame compiled on the first call, none on a call
    its guards accept, one more when a new shape fails them (dynamic=False: no dynamic shapes)."""
    import torch

    from chipset.parallel.compile import compiled_frames

    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    before = compiled_frames()
    f(torch.ones(2))
    first = compiled_frames()
    f(torch.ones(2))
    same = compiled_frames()
    f(torch.ones(3))
    assert (first - before, same - first, compiled_frames() - same) == (1, 0, 1)
