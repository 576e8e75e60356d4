"""Starting the ranks of a conformance session: forks of one server that imported torch once.

A session's rank (the collectives battery's, the engine group's) is the module's
``rank_main(argv)`` run in a process of its own, with the environment and the stderr file
the session gives it. Where multiprocessing's ``forkserver`` start method exists (Linux,
macOS), each rank is a fork of one server per conformance run (``python`` + ``PRELOAD``,
started on the first session and reused by the next), instead of a new interpreter that
imports torch again: the collectives and engine groups on cpu_sim (6 processes) took 55-63 s
of CPU instead of 65-70 on a 2-core machine (2026-12-06, two runs each). The server imports
torch but loads no backend and initialises no device; a rank loads the backend under test
after the fork, as a new interpreter would, and computes on the intra-op threads its
``OMP_NUM_THREADS`` asks for. Elsewhere a rank is ``python -m MODULE ARGV``.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import subprocess
import sys

PRELOAD = ("torch", "torch.distributed", "chipset")
"""What the server imports once for every rank it forks."""
_server: list = []
"""The fork server's pid before this run started one (None: none), once a rank was started."""


class Forked:
    """A rank forked from the server, with as much of ``subprocess.Popen`` as the sessions use."""

    def __init__(self, proc):
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # -N for a signal, as Popen

    def poll(self) -> int | None:
        self._proc.join(0)
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"conformance rank {self.pid}", timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def start(module: str, argv: list[str], env: dict[str, str], stderr_path: str,
          cwd: str | None = None) -> Forked | subprocess.Popen:
    """Start ``module.rank_main(argv)`` as a rank with environment ``env``, its stderr written to
    ``stderr_path`` and its stdout discarded (module docstring: a fork, or a new interpreter)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        with open(stderr_path, "w") as err:
            return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, cwd=cwd,
                                    stdout=subprocess.DEVNULL, stderr=err)
    ctx = multiprocessing.get_context("forkserver")
    if not _server:
        from multiprocessing import forkserver

        from chipset._process import stop_fork_server

        ctx.set_forkserver_preload(list(PRELOAD))
        _server.append(getattr(forkserver._forkserver, "_forkserver_pid", None))
        atexit.register(stop_fork_server, _server[0])  # at the conformance run's end, not after it
    proc = ctx.Process(target=_entry, args=(module, list(argv), dict(env), stderr_path, cwd),
                       name=f"conformance-{module.rsplit('.', 1)[-1]}", daemon=False)
    proc.start()
    return Forked(proc)


def _entry(module: str, argv: list[str], env: dict[str, str], stderr_path: str, cwd: str | None) -> None:
    """In the fork: become ``python -m MODULE ARGV`` with ``env``, then run the rank to its exit."""
    from chipset._process import exit_rank, release_fork_server_pipe

    release_fork_server_pipe()  # else the server outlives the conformance run that started it
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # read by OpenMP when the server imported torch, not now
    sys.argv = [module, *argv]
    exit_rank(importlib.import_module(module).rank_main(argv))
