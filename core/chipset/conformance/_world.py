"""Multi-rank sessions for the collectives group: real processes over loopback.

:func:`run_world` starts ``WORLD`` interpreters (``python -m chipset.conformance._world``)
that rendezvous through ``MASTER_ADDR=127.0.0.1`` and a free port, load the backend
under test by name (``CHIPSET_BACKEND``), bind rank r to device ``r % device_count``
and run the whole battery in one process-group session. Each rank appends one JSON
line per check to its own file, so a crash or a hang still leaves the verdicts of
the checks before it. A session that overruns its deadline is killed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SESSION_COLLECTIVE_TIMEOUT_S = 30
"""CHIPSET_COLLECTIVE_TIMEOUT inside the session: a broken op fails in seconds, not minutes."""


@dataclass
class WorldResult:
    world: int
    per_rank: list[dict[str, dict]] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    stderr_tails: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def verdict(self, check_id: str) -> tuple[str, str]:
        """("passed" | "failed" | "skipped", reason) for one check over every rank."""
        rows = [r.get(check_id) for r in self.per_rank]
        for rank, row in enumerate(rows):
            if row is not None and row["outcome"] == "failed":
                return "failed", f"rank {rank}: {row['message']}"
        missing = [rank for rank, row in enumerate(rows) if row is None]
        if missing:
            rank = missing[0]
            return "failed", (
                f"check did not run on rank(s) {missing}: rank {rank} exited with {self.exit_codes[rank]}; "
                f"stderr tail: {self.stderr_tails[rank][-800:]}"
            )
        if all(row["outcome"] == "skipped" for row in rows):
            return "skipped", rows[0]["message"]
        return "passed", ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(backend: str, world: int, deadline_s: float = 240.0) -> WorldResult:
    """Run the collectives battery on ``world`` ranks of ``backend``; never waits past the deadline."""
    port = _free_port()
    out = WorldResult(world)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chipset-conformance-") as tmp:
        procs, errs = [], []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), CHIPSET_BACKEND=backend,
                CHIPSET_COLLECTIVE_TIMEOUT=str(SESSION_COLLECTIVE_TIMEOUT_S),
            )
            env.pop("CHIPSET_SIM_FAULTS", None)  # the battery certifies the backend, not a fault plan
            err = open(Path(tmp) / f"rank{rank}.err", "w+")  # noqa: SIM115 - closed below
            errs.append(err)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "chipset.conformance._world", str(Path(tmp) / f"rank{rank}.jsonl")],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            ))
        for p in procs:
            left = max(1.0, deadline_s - (time.monotonic() - t0))
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                p.wait()
        for rank, (p, err) in enumerate(zip(procs, errs, strict=True)):
            out.exit_codes.append(p.returncode)
            err.seek(0)
            out.stderr_tails.append(err.read()[-4000:])
            err.close()
            rows: dict[str, dict] = {}
            path = Path(tmp) / f"rank{rank}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip():
                        row = json.loads(line)
                        rows[row["id"]] = row
            out.per_rank.append(rows)
    out.seconds = time.monotonic() - t0
    return out


def _worker(path: str) -> int:
    import torch.distributed as dist

    import chipset
    from chipset.conformance._collective_checks import Ctx, battery, skip_reason

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    b = chipset.backend(os.environ["CHIPSET_BACKEND"])
    b.device.set_device(rank % b.device.device_count())
    b.collective.init_process_group(rank=rank, world_size=world)
    ctx = Ctx(b.collective, b.device, b.device.torch_device(), rank, world)
    with open(path, "w") as f:
        for check in battery():
            why = skip_reason(check, b.capabilities, world)
            if why is not None:
                row = {"id": check.id, "outcome": "skipped", "message": why}
            else:
                try:
                    check.fn(ctx)
                    row = {"id": check.id, "outcome": "passed", "message": ""}
                except Exception as exc:  # a verdict, reported per check
                    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    row = {"id": check.id, "outcome": "failed", "message": tb[:1500]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            # Re-align the ranks after every check so one failure cannot shift the next.
            dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the timeout check leaves a dead group behind; do not wait on its teardown


if __name__ == "__main__":
    from chipset._process import exit_rank

    exit_rank(_worker(sys.argv[1]))
