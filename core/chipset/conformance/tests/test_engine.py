"""Engine parity: the training engine on this backend gives one device's losses under dp, tp, pp and ep.

A tiny fp32 model (2 blocks, hidden 32, vocab 64, seq 16, global batch 8, 4 AdamW steps
with gradient clipping) is trained by :func:`chipset.train.train` on the backend under
test: once on one device (the reference; dense and MoE) and on 2 ranks as dp=2, tp=2,
pp=2 (1F1B, 2 micro-batches) and ep=2 (MoE, 4 experts, top-2). Every per-step loss must
equal the reference's within rtol 1e-5 (or the backend's declared float32 tolerance,
``Capabilities.tolerances["engine/float32"]`` then ``["float32"]``, when that is looser).

Two launches, run at the same time: one 2-rank session of real processes over loopback
(``python -m chipset.conformance.tests.test_engine world``, the pattern of
:mod:`chipset.conformance._world`) runs the four layouts in turn, ranks re-aligned by a
barrier after each; one single process (``... ref``) runs the references. Each process
appends one JSON line per run, so a crash or hang still reports the runs before it; the
launch is killed past its deadline. Rank r binds device ``r % device_count``.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from chipset.conformance import _ranks
from chipset.conformance._world import rank_env, session_store

if TYPE_CHECKING:
    from chipset.loader import Backend

WORLD = 2
STEPS = 4
RTOL = 1e-5
DEADLINE_S = 240.0
SESSION_COLLECTIVE_TIMEOUT_S = 30

BASE = {
    "model": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    # grad_clip below the typical gradient norm, so the global norm (reduced over ranks) matters.
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 7,
              "dtype": "float32", "log_every": 1000},
    "parallel": {"bucket_mb": 0.02},
}
MOE = {"model": {"num_experts": 4, "num_experts_per_tok": 2}}

# run -> (overrides, its one-device reference, collectives it needs besides ALWAYS: measured on cpu_sim)
RUNS: dict[str, tuple[dict, str, tuple[str, ...]]] = {
    "dp2": ({"parallel": {"dp": 2}}, "ref_dense", ()),
    "tp2": ({"parallel": {"tp": 2}}, "ref_dense", ()),
    "pp2_1f1b": ({"parallel": {"pp": 2, "schedule": "1f1b", "micro_batches": 2}}, "ref_dense",
                 ("batch_p2p", "broadcast")),
    "ep2": ({**MOE, "parallel": {"ep": 2}}, "ref_moe", ("all_to_all",)),
}
REFS: dict[str, dict] = {"ref_dense": {}, "ref_moe": MOE}
ALWAYS = ("all_reduce", "all_gather")
"""Every multi-rank run: gradients and losses (all_reduce), the per-step metrics gather (all_gather)."""


def _merge(base: dict, over: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for k, v in over.items():
        out.setdefault(k, {}).update(v)
    return out


def _config(name: str) -> dict:
    return _merge(BASE, REFS[name] if name in REFS else RUNS[name][0])


def skip_reason(name: str, caps) -> str | None:
    """Why ``caps`` rules the run ``name`` out, or None."""
    if not caps.has_dtype("float32"):
        return "backend does not declare dtype float32"
    if "float32" not in caps.collective_dtypes:
        return "backend does not declare collective dtype float32"
    needs = ALWAYS + (RUNS[name][2] if name in RUNS else ())
    for op in needs:
        if not caps.has_collective(op):
            return f"backend does not declare collective {op}"
    return None


def tolerance(caps) -> tuple[float, float]:
    """(rtol, atol) for per-step fp32 losses: rtol 1e-5, or the backend's looser declared fp32 override."""
    for key in ("engine/float32", "float32"):
        if key in caps.tolerances:
            rtol, atol = caps.tolerances[key]
            return max(RTOL, float(rtol)), float(atol)
    return RTOL, 0.0


# --------------------------------------------------------------------------------------
# The launches
# --------------------------------------------------------------------------------------


def _read_rows(path: Path) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["id"]] = row
    return rows


class Session:
    """What every process of the two launches reported, run by run."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, dict]]] = {}  # "world" | "ref" -> per process
        self.exit_codes: dict[str, list[int | None]] = {}
        self.stderr_tails: dict[str, list[str]] = {}
        self.seconds = 0.0

    def result(self, name: str) -> tuple[str, str, list[float] | None]:
        """("passed" | "failed" | "skipped", reason, rank 0's losses) for one run over its processes."""
        launch = "ref" if name in REFS else "world"
        rows = [r.get(name) for r in self.rows[launch]]
        for rank, row in enumerate(rows):
            if row is not None and row["outcome"] == "failed":
                return "failed", f"{name} rank {rank}: {row['message']}", None
        missing = [rank for rank, row in enumerate(rows) if row is None]
        if missing:
            rank = missing[0]
            return "failed", (
                f"{name} did not finish on rank(s) {missing}: rank {rank} exited with "
                f"{self.exit_codes[launch][rank]}; stderr tail: {self.stderr_tails[launch][rank][-800:]}"
            ), None
        if all(row["outcome"] == "skipped" for row in rows):
            return "skipped", rows[0]["message"], None
        return "passed", "", rows[0]["losses"]


def run_session(backend: str, world: int = WORLD, deadline_s: float = DEADLINE_S) -> Session:
    """Start the ``world``-rank session and the one-device reference together; never wait past the deadline."""
    out = Session()
    t0 = time.monotonic()
    store = session_store()
    with tempfile.TemporaryDirectory(prefix="chipset-conformance-engine-") as tmp:
        procs: list[tuple[str, object, Path, Path]] = []
        for launch, size in (("world", world), ("ref", 1)):
            for rank in range(size):
                env = dict(os.environ)
                env.update(
                    RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                    CHIPSET_BACKEND=backend, CHIPSET_COLLECTIVE_TIMEOUT=str(SESSION_COLLECTIVE_TIMEOUT_S),
                    OMP_NUM_THREADS="1",
                )
                if launch == "world":
                    env.update(rank_env(store))
                else:  # one process without a launcher: a private world of one
                    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
                        env.pop(k, None)
                env.pop("CHIPSET_SIM_FAULTS", None)  # the group certifies the backend, not a fault plan
                path = Path(tmp) / f"{launch}{rank}.jsonl"
                err = Path(tmp) / f"{launch}{rank}.err"
                proc = _ranks.start("chipset.conformance.tests.test_engine", [launch, str(path)], env, str(err), cwd=tmp)
                procs.append((launch, proc, err, path))
        for _, p, _, _ in procs:
            left = max(1.0, deadline_s - (time.monotonic() - t0))
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                for _, q, _, _ in procs:
                    if q.poll() is None:
                        q.kill()
                p.wait()
        for launch, p, err, path in procs:
            out.exit_codes.setdefault(launch, []).append(p.returncode)
            out.stderr_tails.setdefault(launch, []).append(err.read_text(errors="replace")[-4000:] if err.exists() else "")
            out.rows.setdefault(launch, []).append(_read_rows(path))
    out.seconds = time.monotonic() - t0
    return out


def _process(launch: str, path: str) -> int:
    import torch.distributed as dist

    import chipset
    from chipset.train import train
    from chipset.train.config import RunConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    b = chipset.backend(os.environ["CHIPSET_BACKEND"])
    b.device.set_device(rank % b.device.device_count())
    b.collective.init_process_group(rank=rank, world_size=world)
    names = list(REFS) if launch == "ref" else list(RUNS)
    with open(path, "w") as f:
        for name in names:
            why = skip_reason(name, b.capabilities)
            if why is not None:
                row = {"id": name, "outcome": "skipped", "message": why}
            else:
                try:
                    cfg = RunConfig.from_dict(_config(name)).validate(world_size=world, dtypes=b.capabilities.dtypes)
                    res = train(cfg, b, None, out=io.StringIO())
                    row = {"id": name, "outcome": "passed", "message": "", "losses": res.losses}
                except Exception as exc:  # a verdict, reported per run
                    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    row = {"id": name, "outcome": "failed", "message": tb[:1500]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if world > 1:
                dist.barrier()  # re-align the ranks so one failed run cannot shift the next
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a failed run may leave a dead group behind; do not wait on its teardown


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session(backend_name, caps, backend: Backend):
    if not caps.multi_process:
        pytest.skip("backend does not declare capability multi_process")
    if not caps.ranks_share_device and backend.device.device_count() < WORLD:
        pytest.skip(
            f"needs {WORLD} devices for a {WORLD}-rank run (ranks cannot share a device on this backend), "
            f"found {backend.device.device_count()}"
        )
    return run_session(backend_name)


@pytest.mark.parametrize("run", list(RUNS))
def test_losses_equal_one_device(request, caps, run):
    why = skip_reason(run, caps)
    if why is not None:
        pytest.skip(why)
    session = request.getfixturevalue("session")  # launched once, by the first run not skipped
    outcome, reason, losses = session.result(run)
    if outcome == "skipped":
        pytest.skip(reason)
    if outcome == "failed":
        pytest.fail(reason, pytrace=False)
    ref_name = RUNS[run][1]
    ref_outcome, ref_reason, ref = session.result(ref_name)
    if ref_outcome != "passed":
        pytest.fail(f"the one-device reference {ref_name} did not run: {ref_reason or ref_outcome}", pytrace=False)
    assert len(ref) == STEPS and all(math.isfinite(x) for x in ref), f"{ref_name} losses: {ref}"
    assert ref[-1] < ref[0], f"{ref_name} did not learn, parity would be vacuous: {ref}"
    assert len(losses) == STEPS, f"{run}: {len(losses)} steps, expected {STEPS}"
    rtol, atol = tolerance(caps)
    bad = [i for i, (a, r) in enumerate(zip(losses, ref, strict=True))
           if not (math.isfinite(a) and abs(a - r) <= atol + rtol * abs(r))]
    if bad:
        i = bad[0]
        pytest.fail(
            f"{run} loss differs from one device at step(s) {[s + 1 for s in bad]} (rtol {rtol:g}, atol {atol:g}): "
            f"step {i + 1}: {losses[i]!r} vs {ref[i]!r}; {run} {losses} vs {ref_name} {ref}",
            pytrace=False,
        )


def rank_main(argv: list[str]) -> int:
    """One process of the session (chipset.conformance._ranks): ``argv`` is its launch and JSON-lines file."""
    return _process(argv[0], argv[1])


if __name__ == "__main__":
    from chipset._process import exit_rank

    exit_rank(rank_main(sys.argv[1:]))
