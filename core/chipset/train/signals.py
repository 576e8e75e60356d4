"""Stopping a job on SIGINT/SIGTERM: every rank stops at the same step, saves once, and exits quietly.

Why: a signal reaches the ranks at different times (or only one of them), so a rank that
acted on it alone would leave its peers blocked in a collective, and Python's default
``KeyboardInterrupt`` prints a traceback per rank. Instead each rank's handler only sets a
flag; at the end of every step the ranks take the maximum of their flags (one small
all-reduce), and when it is set they all save one checkpoint through the run's
:class:`~chipset.train.checkpoint.Checkpointer` (when ``train.checkpoint_every > 0``) and
raise :class:`Interrupted`. Under torchrun the ranks then exit 0 (so the agent neither
restarts them nor prints its failure report) after rank 0 wrote ``RUN_DIR/interrupted.json``;
the launcher reads it and prints one line and exits 128 + the signal number.

The launcher runs torchrun in its own session, so a terminal's Ctrl-C reaches only the
launcher, which forwards the signal to the ranks (torchrun starts each rank in a session of
its own, out of reach of the terminal).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from chipset.errors import ChipsetError

__all__ = ["Interrupted", "install", "installed", "stop_point", "write_stop", "take_stop", "run_forwarding",
           "die_with_parent", "resume_hint"]

log = logging.getLogger(__name__)

STOP_FILE = "interrupted.json"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received = 0


class Interrupted(ChipsetError):
    """The ranks agreed to stop after ``step`` completed steps because of signal ``signum``."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")


_agreed = threading.Event()


def _note(signum, frame) -> None:
    global _received
    if not _received:
        _received = signum
        threading.Thread(target=_grace, args=(signum,), name="chipset-stop-grace", daemon=True).start()


def _grace(signum: int) -> None:
    """End this rank if it does not reach the end of its step soon after the signal.

    Why: torchrun's agent also sends SIGTERM to the surviving ranks when one rank failed; a
    survivor blocked in a collective with a dead or hung peer would otherwise wait for the
    agent's SIGKILL. ``CHIPSET_STOP_GRACE_S`` (default 15) bounds it; the checkpoint save
    after the ranks agreed is not bounded.
    """
    try:
        grace = float(os.environ.get("CHIPSET_STOP_GRACE_S", "15"))
    except ValueError:
        grace = 15.0
    if not _agreed.wait(grace):
        rank = os.environ.get("RANK", "0")
        log.error("rank %s did not reach the end of its step within %g s of %s; exiting",
                  rank, grace, signal.Signals(signum).name)
        logging.shutdown()  # flush before the hard exit
        os._exit(128 + signum)


def install() -> None:
    """Make SIGINT/SIGTERM set this process's stop flag instead of raising (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for s in _SIGNALS:
            signal.signal(s, _note)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the block, then the caller's handlers and a clear stop flag again:
    a run inside the caller's process (one rank, a notebook) must leave Ctrl-C as it found it."""
    global _received
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in _SIGNALS} if main else {}
    install()
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        _received = 0
        _agreed.clear()


def requested() -> int:
    return _received


def stop_point(col, device, step: int, ckpt) -> None:
    """End of a step (collective): raise :class:`Interrupted` on every rank when any rank got a signal.

    ``step`` is the number of completed steps. With checkpoints on, the state after it is saved
    first (unless this step's regular save already wrote it) and the save has finished.
    """
    import torch

    flag = _received
    if col.world_size() > 1:
        t = torch.tensor([float(flag)], dtype=torch.float32, device=device)
        col.all_reduce(t, "max")
        flag = int(t.item())
    if not flag:
        return
    _agreed.set()
    path = None
    if ckpt is not None and ckpt.every > 0:
        from chipset.train.checkpoint import store

        if step not in ckpt.saved:
            ckpt.save(step)
        ckpt.finish()
        path = str(store.checkpoint_dir(ckpt.run_dir, step))
    raise Interrupted(flag, step, path)


def write_stop(run_dir: str | Path, exc: Interrupted) -> None:
    """Rank 0 under torchrun: tell the launcher where the job stopped."""
    body = {"signal": exc.signum, "step": exc.step, "checkpoint": exc.checkpoint}
    tmp = Path(run_dir) / (STOP_FILE + ".tmp")
    tmp.write_text(json.dumps(body) + "\n")
    os.replace(tmp, Path(run_dir) / STOP_FILE)


def take_stop(run_dir: str | Path) -> Interrupted | None:
    """The stop the ranks recorded in ``run_dir`` (the file is removed), or None."""
    path = Path(run_dir) / STOP_FILE
    try:
        body = json.loads(path.read_text())
        path.unlink()
        return Interrupted(int(body["signal"]), int(body["step"]), body.get("checkpoint"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_hint(exc: Interrupted | None, signum: int | None = None, argv: list[str] | None = None) -> str:
    """The one line the launcher prints after an interrupted job."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            kept.append(a)
    again = shlex.join(["chipset", *kept, "--resume", "auto"])
    if exc is None:
        name = signal.Signals(signum).name if signum else "a signal"
        return f"chipset train: interrupted by {name} before the first step completed; nothing saved"
    if exc.checkpoint:
        return (f"chipset train: interrupted at step {exc.step}; checkpoint saved to {exc.checkpoint}; "
                f"resume with: {again}")
    return (f"chipset train: interrupted at step {exc.step}; no checkpoint saved (train.checkpoint_every is 0)")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def agent_ranks(agent: int) -> list[int]:
    """The ranks of a torchrun agent: its children, except that the children of a multiprocessing fork
    server it started are its ranks (chipset's agent forks them so: train/agent.py) and the server and
    multiprocessing's resource tracker are not."""
    out = []
    for pid in _children(agent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            out += _children(pid)
        elif b"multiprocessing.resource_tracker" not in cmdline:
            out.append(pid)
    return out


def run_forwarding(cmd: list[str], env: dict) -> tuple[int, int]:
    """Run torchrun in its own session and forward SIGINT/SIGTERM to its ranks.

    Returns (torchrun's exit status, the signal received or 0). The first signal goes to the
    ranks (the agent where it has none yet), which stop at the end of their step; a second one
    kills the agent and its ranks. chipset's own agent (``-m chipset.train.agent``) starts as a
    fork of this process where that is safe (train/agent.py), else as a new interpreter.
    """
    proc = None
    if cmd[:3] == [sys.executable, "-m", "chipset.train.agent"]:
        from chipset.train.agent import fork

        proc = fork(cmd[3:], env)
    if proc is None:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    got: list[int] = []

    def forward(signum, frame) -> None:
        got.append(signum)
        first = len(got) == 1
        ranks = agent_ranks(proc.pid)
        for pid in (ranks or [proc.pid]) if first else [*ranks, proc.pid]:
            try:
                os.kill(pid, signum if first else signal.SIGKILL)
            except OSError:
                pass

    main = threading.current_thread() is threading.main_thread()  # handlers: main thread only
    old = {s: signal.signal(s, forward) for s in _SIGNALS} if main else {}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc, (got[0] if got else 0)


def die_with_parent() -> None:
    """A torchrun rank: be killed when the agent dies, even by SIGKILL (Linux; a no-op elsewhere).

    Why: without it a SIGKILLed agent leaves its ranks training and saving with nobody to stop
    them. The kernel delivers the signal when the parent exits; a parent gone before the
    call is caught by the ppid check.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
