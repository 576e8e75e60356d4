"""A run directory's own bookkeeping: the exclusive lock, the run id, atomic and strict JSON writes.

Why these exist: two ``chipset train`` on one ``--run-dir`` used to interleave metrics and
mix checkpoints; an earlier run's checkpoints were taken for the current run's; a crash or
a full disk mid-write left a half-written ``summary.json``. See docs/fault-tolerance.md
("Run directories").
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from chipset.errors import ChipsetError, UsageError

__all__ = ["LOCK", "RUN", "DiskFullError", "RunDirLocked", "RunLock", "atomic_write_text", "read_run_id",
           "write_run_id", "ensure_run_id", "new_run_id", "finite_json", "strict_dumps", "disk_full",
           "find_enospc", "finished_step", "finished_message"]

log = logging.getLogger(__name__)

LOCK = ".lock"
RUN = "run.json"


class RunDirLocked(UsageError):
    """Another ``chipset train`` holds the run directory (exit 2)."""


class DiskFullError(ChipsetError):
    """A write failed with ENOSPC; the message names the path and the free space."""


# --- the lock ----------------------------------------------------------------------------------
class RunLock:
    """An ``fcntl.flock`` on ``RUN_DIR/.lock``, held by the launcher for the whole job.

    ``shared=True`` is for the nodes of one multi-node job that share a run directory:
    they may hold it together, but never alongside a single-node job. The holder's pid,
    host, start time and command are written into the file for the refusal message.
    The file is never deleted (deleting a locked file would let a third run lock a new one).
    """

    def __init__(self, run_dir: str | Path, *, shared: bool = False, what: str = "chipset train"):
        self.path = Path(run_dir) / LOCK
        self.shared = shared
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirLocked(
                f"run directory {self.path.parent} is in use by another job ({self.holder()}); two jobs on one "
                "run directory would mix their metrics and checkpoints. Wait for it to finish, stop it, or "
                "choose another --run-dir") from None
        self._fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "what": self.what,
                "shared": self.shared}
        if not self.shared:  # shared holders keep the first holder's record
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return self

    def holder(self) -> str:
        """Who holds the lock, from what the holder wrote into the file."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict) or "pid" not in info:
            return "holder unknown"
        return (f"{info.get('what', 'chipset train')} pid {info.get('pid')} on host {info.get('host')}, "
                f"started {info.get('started')}")

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- writes ------------------------------------------------------------------------------------
def disk_full(path: str | Path, exc: BaseException) -> DiskFullError:
    """chipset's error for an ENOSPC while writing ``path``: plain words, the free space, what to do."""
    where = Path(path)
    probe = where if where.is_dir() else where.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(f"no space left on device while writing {where} ({free} on that filesystem); "
                         f"free space or choose a --run-dir on another filesystem, then run the same command "
                         f"again ({exc})")


def find_enospc(exc: BaseException | None) -> OSError | None:
    """The ENOSPC OSError inside ``exc`` (its cause/context chain, or args of a wrapping error), if any."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        todo += [e.__cause__, e.__context__]
        for a in getattr(e, "args", ()):
            if isinstance(a, BaseException):
                todo.append(a)
            elif isinstance(a, dict):  # torch's CheckpointException: {rank: exception}
                todo += [v for v in a.values() if isinstance(v, BaseException)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [v for v in failures.values() if isinstance(v, BaseException)]
            todo += [v[0] for v in failures.values() if isinstance(v, tuple) and v
                     and isinstance(v[0], BaseException)]
    return None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temp file in the same folder, fsync, ``os.replace``.

    A crash leaves the previous content; a full disk raises :class:`DiskFullError` and
    leaves the previous content (never a 0-byte file).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if exc.errno == errno.ENOSPC:
            raise disk_full(path, exc) from exc
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def finite_json(obj: Any, where: str = "", bad: list[str] | None = None) -> Any:
    """``obj`` with every NaN/inf float replaced by None; their paths appended to ``bad``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if bad is not None:
            bad.append(f"{where or 'value'}={obj}")
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v, f"{where}.{k}" if where else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v, f"{where}[{i}]", bad) for i, v in enumerate(obj)]
    return obj


def strict_dumps(obj: Any, **kw) -> str:
    """JSON without NaN/Infinity tokens (non-finite floats become null), so every parser reads it."""
    return json.dumps(finite_json(obj), allow_nan=False, **kw)


# --- run id ------------------------------------------------------------------------------------
def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def read_run_id(run_dir: str | Path) -> str | None:
    """The run id recorded in ``RUN_DIR/run.json``, or None (no file, or not readable)."""
    try:
        info = json.loads((Path(run_dir) / RUN).read_text())
    except (OSError, ValueError):
        return None
    rid = info.get("run_id") if isinstance(info, dict) else None
    return rid if isinstance(rid, str) and rid else None


def write_run_id(run_dir: str | Path, run_id: str | None = None) -> str:
    """Record ``run_id`` (a new one if None) as the run directory's current run; returns it."""
    run_id = run_id or new_run_id()
    atomic_write_text(Path(run_dir) / RUN, json.dumps({"run_id": run_id, "created_unix": time.time()}) + "\n")
    return run_id


def ensure_run_id(run_dir: str | Path) -> str:
    """The run directory's run id, creating one when there is none yet (the in-process API path)."""
    return read_run_id(run_dir) or write_run_id(run_dir)


# --- a finished run ------------------------------------------------------------------------------
def finished_step(run_dir: str | Path, steps: int) -> int | None:
    """The step the run directory's current run finished at, when that is >= ``steps``; else None.

    Read from ``summary.json`` (written only when a run completes) and accepted only when its
    ``run_id`` is the one in ``run.json``: a summary of an earlier run, or from before run ids,
    says nothing about the current one.
    """
    run_id = read_run_id(run_dir)
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if run_id is None or not isinstance(summary, dict) or summary.get("run_id") != run_id:
        return None
    done = summary.get("steps")
    return done if isinstance(done, int) and not isinstance(done, bool) and done >= steps else None


def finished_message(run_dir: str | Path, step: int) -> str:
    """What ``chipset train --resume auto`` prints for a run that has nothing left to do (exit 0)."""
    return (f"chipset train: run in {run_dir} already finished at step {step}; raise train.steps to continue, "
            "or use a new --run-dir (nothing was trained; summary.json and metrics.jsonl are kept)")
