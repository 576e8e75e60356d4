"""torchrun's elastic agent, started so that a single-node job exposes nothing to the network.

``python -m chipset.train.agent ARGS`` is ``python -m torch.distributed.run ARGS`` with two
differences:

- **Loopback stores.** With ``CHIPSET_STORES_LOOPBACK=1`` (the launcher sets it for
  single-node jobs) every TCP store the agent hosts (the rendezvous store, which the ranks
  share) listens on 127.0.0.1 only. torch's ``TCPStore`` server otherwise listens on all
  interfaces, whatever address it is given, so any host that can reach the machine could
  join or poison the job. The store is handed a socket already bound to loopback
  (``master_listen_fd``). Multi-node jobs must be reachable from the other nodes and keep
  torch's behaviour (bind the rendezvous to a private interface with ``--rdzv-endpoint``
  and ``--local-addr``; see docs/fault-tolerance.md, "Multi-node").
- **No current directory on the import path.** ``python -m`` puts the current directory
  first on ``sys.path``, so a ``typing_extensions.py`` (or any module name torch imports)
  lying there would run inside the agent. It is removed before torch is imported; the
  launcher also sets ``PYTHONSAFEPATH=1`` (Python >= 3.11) so the ranks start without it.

**Started as a fork of the launcher** (:func:`fork`, Linux, where the launcher runs one thread):
the ``chipset`` command has imported torch already, so a forked agent starts without importing
it again (about 1.7 s of CPU per job on a 2-core machine, 2026-12-06, and as much launch latency).
The child is what ``python -m chipset.train.agent ARGS`` would be: its own session, the job's
environment, fresh signal handlers and exit functions, no current directory on its import path.
Its command line stays the launcher's; torch's agent names the process ``pt_elastic``
(``/proc/PID/comm``, what ``ps -o comm`` and ``top`` show).
Elsewhere, or with other threads running (a fork copies only the calling one), the launcher
starts the module as a new interpreter.

**Its ranks are forks too**, of one multiprocessing fork server per job that imported torch once
(:func:`main`, docs/engine.md), where torchrun would start a new interpreter per rank.
"""

from __future__ import annotations

import os
import sys

# Run as ``python -m``: before anything imports. Imported (the launcher's fork) it leaves the importer's path alone.
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

import atexit  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402


def _loopback_store_class(base):
    class LoopbackTCPStore(base):
        """A TCPStore whose server listens on 127.0.0.1 only (clients are unchanged)."""

        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            if is_master and kwargs.get("master_listen_fd") is None and len(args) < 4:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", int(port)))
                sock.listen(1024)
                kwargs["master_listen_fd"] = sock.detach()
                host_name = "127.0.0.1"
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    return LoopbackTCPStore


RANK_PRELOAD = ("torch", "torch.distributed.checkpoint", "chipset.train.agent")
"""What a job's fork server imports once for all its ranks (:func:`main`): torch, torch's checkpoint
module (which every rank imports for the run's last checkpoint), and this module; then the rank's own
module (``-m MODULE``)."""


def main(args: list[str] | None = None) -> None:
    """torchrun's ``main`` on ``args`` (default: the command line's).

    A rank given as ``-m MODULE ARGS`` (chipset's own workers) starts as a fork of a server that
    imported torch once for the whole job (multiprocessing's ``forkserver``: a new interpreter,
    started by this agent before any rank, which initialises no device), instead of a new
    interpreter per rank that imports torch again: about 2 s of CPU and as much start-up time
    saved per rank after the first (2026-12-06, a 2-core machine). The rank runs
    :func:`rank_entry`, which is ``python -m MODULE ARGS`` minus the interpreter's start and
    teardown. Elsewhere (no ``forkserver``, or another entry point) ranks are new interpreters, as
    torchrun starts them.
    """
    if os.environ.get("CHIPSET_STORES_LOOPBACK") == "1":
        import torch.distributed as dist

        dist.TCPStore = _loopback_store_class(dist.TCPStore)  # before torch's launcher imports it
    import torch.multiprocessing
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    @record
    def run(argv):  # torch.distributed.run's main and run, for the c10d rendezvous the launcher always names
        name = getattr(torch.multiprocessing, "_set_thread_name", None)
        if name is not None:
            name("pt_elastic")  # as torchrun names its agent
        ns = torchrun.parse_args(argv)
        config, cmd, cmd_args = torchrun.config_from_args(ns)
        fork = _forked_rank(cmd, cmd_args)
        if fork is None:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
            return
        import logging
        from multiprocessing import forkserver

        config.start_method = "forkserver"
        forkserver.set_forkserver_preload([*RANK_PRELOAD, fork[0]])
        os.environ["PYTHONUNBUFFERED"] = "1"  # the server's (and so the ranks') stdio, as ``python -u``
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietExit())
        from chipset._process import stop_fork_server

        before = getattr(forkserver._forkserver, "_forkserver_pid", None)
        try:
            elastic_launch(config=config, entrypoint=rank_entry)(*fork)
        finally:
            stop_fork_server(before)

    run(args)


class _QuietExit:
    """A logging filter for torch's agent: a forked rank that exits with a status is logged with a
    traceback of torch's own bookkeeping (``ProcessExitedException``); the rank printed why it
    failed, and the agent's failure report names its exit status, so the traceback is dropped."""

    def filter(self, record) -> bool:
        if record.exc_info and type(record.exc_info[1]).__name__ == "ProcessExitedException":
            record.exc_info, record.exc_text = None, None
        return True


def _forked_rank(cmd, cmd_args: list[str]) -> list[str] | None:
    """``[MODULE, *ARGS]`` for a rank command ``python -u -m MODULE ARGS`` that can start from a fork
    server here, else None."""
    import multiprocessing

    if (cmd != sys.executable or cmd_args[:2] != ["-u", "-m"] or len(cmd_args) < 3
            or "forkserver" not in multiprocessing.get_all_start_methods()):
        return None
    return cmd_args[2:]


def rank_entry(module: str, *argv: str) -> None:
    """A rank forked from the job's fork server: ``python -m MODULE ARGV``, whose ``main(argv)``
    returns the rank's exit status; a status other than 0 ends the process with it."""
    import importlib

    from chipset._process import release_fork_server_pipe

    # Else a SIGKILLed agent would leave the server, and so this rank (its parent-death signal,
    # chipset.train.signals.die_with_parent), alive.
    release_fork_server_pipe()
    sys.argv = [module, *argv]
    code = importlib.import_module(module).main(list(argv))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code:
        raise SystemExit(code)


class Forked:
    """The forked agent, as much of ``subprocess.Popen`` as the launcher uses (``pid``, ``wait``)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)  # -N for a signal, as Popen
        return self.returncode


def fork(args: list[str], env: dict[str, str]) -> Forked | None:
    """Start ``python -m chipset.train.agent ARGS`` as a fork of this process (module docstring);
    None where a fork is not safe here (not Linux, or threads other than this one running)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    from chipset._process import exit_process

    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing buffered is written twice
    pid = os.fork()
    if pid:
        return Forked(pid)
    code: object = 1
    try:  # the child: what a new interpreter running this module would be
        os.setsid()
        atexit._clear()  # the launcher's exit functions are the launcher's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        if sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
            del sys.path[0]
        sys.argv = [sys.argv[0], *args]
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # a failed worker group raises: torch's traceback and exit 1, as a new interpreter
        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    from chipset._process import exit_process

    try:
        main()
    except SystemExit as exc:
        exit_process(exc.code)
    exit_process(0)  # a failed worker group raises (torch's traceback and exit 1, as before)
