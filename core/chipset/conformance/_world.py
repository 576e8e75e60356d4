"""Multi-rank sessions for the collectives group: real processes over loopback.

:func:`run_world` starts ``WORLD`` ranks (``chipset.conformance._world``, forks of a server
that imported torch once: chipset.conformance._ranks) that rendezvous at a store this
process hosts on a free loopback port, load the backend under test by name
(``CHIPSET_BACKEND``), bind rank r to device ``r % device_count`` and run the whole
battery in one process-group session. Each rank appends one JSON
line per check to its own file, so a crash or a hang still leaves the verdicts of
the checks before it. A session that overruns its deadline is killed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from chipset.conformance import _ranks

SESSION_COLLECTIVE_TIMEOUT_S = 30
"""CHIPSET_COLLECTIVE_TIMEOUT inside the session: a broken op fails in seconds, not minutes."""
WATCHDOG_MARGIN_S = 15
"""A rank still inside a check this long past the session's collective timeout reports it hung."""
AFTER_FAILURE_S = 5
"""Once a rank has exited with a failure, the other ranks get this long before they are stopped."""


@dataclass
class WorldResult:
    world: int
    per_rank: list[dict[str, dict]] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    stderr_tails: list[str] = field(default_factory=list)
    seconds: float = 0.0
    seed: int = 0
    deadline_hit: float | None = None
    """The session deadline in seconds when the session was stopped by it."""

    def verdict(self, check_id: str) -> tuple[str, str]:
        """("passed" | "failed" | "skipped", reason) for one check over every rank."""
        rows = [r.get(check_id) for r in self.per_rank]
        for rank, row in enumerate(rows):
            if row is not None and row["outcome"] == "failed":
                return "failed", f"rank {rank}: {row['message']} (CHIPSET_CONFORMANCE_SEED={self.seed} replays it)"
        missing = [rank for rank, row in enumerate(rows) if row is None]
        if missing:
            rank = missing[0]
            if self.deadline_hit is not None:
                return "failed", (
                    f"check did not run on rank(s) {missing}: the session was stopped at its "
                    f"{self.deadline_hit:g} s deadline before reaching it (seed {self.seed})"
                )
            return "failed", (
                f"check did not run on rank(s) {missing}: rank {rank} exited with {self.exit_codes[rank]} "
                f"(seed {self.seed}); "
                f"stderr tail: {self.stderr_tails[rank][-800:]}"
            )
        if all(row["outcome"] == "skipped" for row in rows):
            return "skipped", rows[0]["message"]
        return "passed", ""


def session_store():
    """The rendezvous store of a session, hosted by this process on a free loopback port.

    The ranks reach it as clients (``rank_env``), as torchrun's workers reach their agent's:
    no port is picked free and then bound later by a rank, which another process on a busy
    host could take in between (every check of the session then fails to start).
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def rank_env(store) -> dict[str, str]:
    """What a rank needs to join the session whose store is ``store``."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0"}


def session_seed() -> int:
    """``CHIPSET_CONFORMANCE_SEED`` when set (to replay a failure), else a fresh random seed."""
    raw = os.environ.get("CHIPSET_CONFORMANCE_SEED", "").strip()
    if raw:
        try:
            return int(raw)
        except ValueError:
            from chipset.errors import ConfigError

            raise ConfigError(f"CHIPSET_CONFORMANCE_SEED must be an integer, found {raw!r}") from None
    return random.SystemRandom().randrange(1 << 31)


def run_world(backend: str, world: int, deadline_s: float = 900.0, only: list[str] | None = None,
              seed: int | None = None) -> WorldResult:
    """Run the collectives battery (or the checks in ``only``) on ``world`` ranks of ``backend``.

    Never waits past the deadline, a backstop only: each check is bounded by its rank's
    watchdog, so the deadline is generous enough for the whole battery on a loaded host.
    Once one rank has exited with a failure (a watchdog verdict), the others get a few
    seconds and are then stopped.
    """
    store = session_store()
    out = WorldResult(world)
    out.seed = session_seed() if seed is None else seed
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chipset-conformance-") as tmp:
        procs, errs = [], []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                **rank_env(store), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), CHIPSET_BACKEND=backend,
                CHIPSET_COLLECTIVE_TIMEOUT=str(SESSION_COLLECTIVE_TIMEOUT_S),
                CHIPSET_CONFORMANCE_SEED=str(out.seed),
                CHIPSET_CONFORMANCE_ONLY=",".join(only or []),
            )
            env.pop("CHIPSET_SIM_FAULTS", None)  # the battery certifies the backend, not a fault plan
            errs.append(Path(tmp) / f"rank{rank}.err")
            procs.append(_ranks.start("chipset.conformance._world", [str(Path(tmp) / f"rank{rank}.jsonl")],
                                      env, str(errs[-1])))
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now - t0 > deadline_s:
                out.deadline_hit = deadline_s
            if now - t0 > deadline_s or (failed_at is not None and now - failed_at > AFTER_FAILURE_S):
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                for q in procs:
                    q.wait()
                break
            time.sleep(0.05)
        for rank, (p, err) in enumerate(zip(procs, errs, strict=True)):
            out.exit_codes.append(p.returncode)
            out.stderr_tails.append(err.read_text(errors="replace")[-4000:] if err.exists() else "")
            rows: dict[str, dict] = {}
            path = Path(tmp) / f"rank{rank}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip():
                        row = json.loads(line)
                        rows[row["id"]] = row
            out.per_rank.append(rows)
    del store
    out.seconds = time.monotonic() - t0
    return out


def _watchdog(f, check, rank: int) -> threading.Timer:
    """Writes ``check``'s hang verdict and ends the rank if the check is still running when it fires."""
    limit = check.watchdog_s or SESSION_COLLECTIVE_TIMEOUT_S + WATCHDOG_MARGIN_S
    message = (check.hang_message or "check did not finish on rank {rank} within {seconds:g} s "
               "(the session's collective timeout is " + str(SESSION_COLLECTIVE_TIMEOUT_S) + " s): it hung")

    def fire() -> None:
        f.write(json.dumps({"id": check.id, "outcome": "failed",
                            "message": message.format(rank=rank, seconds=limit)}) + "\n")
        f.flush()
        sys.stderr.flush()
        os._exit(3)

    t = threading.Timer(limit, fire)
    t.daemon = True
    t.start()
    return t


def _worker(path: str) -> int:
    import zlib

    import torch.distributed as dist

    import chipset
    from chipset.conformance._collective_checks import Ctx, battery, skip_reason

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seed = int(os.environ.get("CHIPSET_CONFORMANCE_SEED") or 0)
    only = {c for c in os.environ.get("CHIPSET_CONFORMANCE_ONLY", "").split(",") if c}
    b = chipset.backend(os.environ["CHIPSET_BACKEND"])
    b.device.set_device(rank % b.device.device_count())
    b.collective.init_process_group(rank=rank, world_size=world)
    ctx = Ctx(b.collective, b.device, b.device.torch_device(), rank, world)
    checks = [c for c in battery() if not only or c.id in only]
    with open(path, "w") as f:
        for i, check in enumerate(checks):
            why = skip_reason(check, b.capabilities, world)
            if why is not None:
                row = {"id": check.id, "outcome": "skipped", "message": why}
            else:
                ctx.seed = (seed ^ zlib.crc32(check.id.encode())) & 0x7FFFFFFF
                dog = _watchdog(f, check, rank)
                try:
                    check.fn(ctx)
                    row = {"id": check.id, "outcome": "passed", "message": ""}
                except Exception as exc:  # a verdict, reported per check
                    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    row = {"id": check.id, "outcome": "failed", "message": tb[:1500]}
                finally:
                    dog.cancel()
            f.write(json.dumps(row) + "\n")
            f.flush()
            # Re-align the ranks after every check so one failure cannot shift the next (not
            # after the last: the timeout check leaves its group, and perhaps a rank, behind).
            if i < len(checks) - 1:
                dist.barrier()
    # Stay connected until rank 0 is done: its last check (the timeout one) must see its
    # peer silent, not gone (a closed connection is an error, not a timeout).
    done = Path(path).with_name("rank0.done")
    if rank == 0:
        done.touch()
    else:
        t0 = time.monotonic()
        while not done.exists() and time.monotonic() - t0 < SESSION_COLLECTIVE_TIMEOUT_S + WATCHDOG_MARGIN_S:
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the timeout check leaves a dead group behind; do not wait on its teardown


def rank_main(argv: list[str]) -> int:
    """One rank of a session (chipset.conformance._ranks): ``argv`` is its JSON-lines file."""
    return _worker(argv[0])


if __name__ == "__main__":
    from chipset._process import exit_rank

    exit_rank(rank_main(sys.argv[1:]))
