"""Checkpoints are written through DCP's own save protocol, never torch's deprecated ShardedTensor.

Issue 19: every save built a ``torch.distributed._shard`` ShardedTensor per logical tensor and
silenced the deprecation warnings that came with it. Now a save planner writes each rank's boxes
as DCP chunks. The files keep DCP's standard ``.metadata`` (tensor size plus chunks), read
through chipset's allow-list unpickler, and a tensor some rank holds no box of is still
recorded whole (by the ranks that hold it) and resumes under another world size.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

import forked_cli
import testenv
from chipset.train.checkpoint import store

CORE = Path(__file__).resolve().parents[2] / "core" / "chipset"

# Saves at steps 1 and 2 in one process (gloo world of 1), recording every warning and the
# types of the state dict values chipset gives dcp.save.
_SAVE = """
import json, sys, warnings
from chipset.train.config import resolve_config
from chipset.train.loop import train
from chipset.loader import backend
cfg = resolve_config(None, ["train.steps=2", "train.global_batch=4", "train.checkpoint_every=1"], world_size=1)
b = backend(); b.collective.init_process_group()
import torch.distributed.checkpoint as dcp
given, real_save = set(), dcp.save
def save(state_dict, **kw):  # what chipset hands DCP (the save itself is DCP's)
    given.update(f"{type(v).__module__}.{type(v).__qualname__}" for v in state_dict.values())
    return real_save(state_dict, **kw)
dcp.save = save
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    train(cfg, b, sys.argv[1])
print("WARNINGS " + json.dumps([[w.category.__name__, str(w.message), w.filename] for w in got]))
print("GIVEN " + json.dumps(sorted(given)))
"""


def _env() -> dict:
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


def _metadata(ckpt: Path):
    return store.safe_reader(ckpt).read_metadata()  # the allow-list unpickler accepts what is written


def _tiles(md) -> dict[str, tuple[int, ...]]:
    """{key: size} of the logical tensors, after checking their chunks fill them exactly once."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, m in md.state_dict_metadata.items():
        assert isinstance(m, TensorStorageMetadata), (key, type(m))
        if key.startswith("rng."):
            continue
        cells = set()
        for c in m.chunks:
            assert all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, m.size, strict=True)), (key, c)
            grid = [range(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True)]
            box = {tuple(ix) for ix in _product(grid)}
            assert not cells & box, f"{key}: chunk {c} overlaps another"
            cells |= box
        assert len(cells) == math.prod(m.size), f"{key}: chunks cover {len(cells)} of {math.prod(m.size)}"
        out[key] = tuple(m.size)
    return out


def _product(ranges):
    import itertools

    return itertools.product(*ranges)


def test_core_never_imports_torchs_deprecated_sharded_tensor():
    found = []
    pattern = re.compile(r"torch\.distributed\._shard\b|from\s+torch\.distributed\s+import\s+[^\n]*\b_shard\b")
    for f in sorted(CORE.rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{f.relative_to(CORE.parent)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_save_emits_no_deprecation_warning_and_writes_standard_dcp_metadata(tmp_path):
    run = tmp_path / "run"
    r = forked_cli.run([sys.executable, "-c", _SAVE, str(run)], capture_output=True, text=True,
                       env={**_env(), "CHIPSET_BACKEND": "cpu_sim"}, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("WARNINGS "))
    warned = json.loads(line.removeprefix("WARNINGS "))
    deprecations = [w for w in warned if w[0] in ("DeprecationWarning", "FutureWarning")]
    assert not deprecations, deprecations
    given = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("GIVEN ")).removeprefix("GIVEN "))
    assert given == ["torch.Tensor"]  # whole plain tensors (RNG states); the boxes go through the planner
    ckpt = store.checkpoint_dir(run, 2)
    assert store.verify(ckpt) is None
    sizes = _tiles(_metadata(ckpt))
    shapes = json.loads((ckpt / store.STATE).read_text())["shapes"]
    for kind in ("model", "optim.master", "optim.exp_avg", "optim.exp_avg_sq"):
        assert {k.removeprefix(kind + "."): list(v) for k, v in sizes.items() if k.startswith(kind + ".")} == shapes, kind


@pytest.mark.multirank
def test_tensors_held_by_one_rank_are_recorded_whole_and_resume_in_one_process(tmp_path):
    # dp2, ZeRO 1, small buckets: most parameters lie inside one rank's half of their bucket,
    # so that rank alone writes them; the checkpoint still holds every tensor whole.
    run, again = tmp_path / "dp2", tmp_path / "one"
    common = ["--set", "train.global_batch=4", "--set", "parallel.bucket_mb=0.02", "--set", "train.checkpoint_every=2"]
    env = {**_env(), "PYTHONWARNINGS": "always::FutureWarning,always::DeprecationWarning"}
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--set", "parallel.zero=1",
                        "--set", "train.steps=2", *common, "--run-dir", str(run)],
                       capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "ShardedTensor" not in out and "DTensor instead" not in out, out[-3000:]
    ckpt = store.checkpoint_dir(run, 2)
    md = _metadata(ckpt)
    _tiles(md)
    files: dict[str, set[str]] = {}
    for index, info in md.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    model = {k: v for k, v in files.items() if k.startswith("model.")}
    assert {f for v in model.values() for f in v} == {"__0_0.distcp", "__1_0.distcp"}
    alone = [k for k, v in model.items() if len(v) == 1]
    assert alone, "expected parameters written by one rank only"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", "train.steps=3", *common,
                        "--resume", str(ckpt), "--run-dir", str(again)],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"resumed from {ckpt} (step 2)" in r.stdout
    summary = json.loads((again / "summary.json").read_text())
    assert summary["resharded"]["from"]["world_size"] == 2 and summary["resharded"]["to"]["world_size"] == 1

