"""Ending a process: a rank's, and a command line's (the ``chipset`` command, torchrun's agent)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_rank(code: int) -> NoReturn:
    """Flush stdio and end this rank's process now, skipping interpreter teardown.

    Why: after the process group is destroyed and every file is closed, torch 2.13 on
    gloo occasionally aborts during interpreter teardown ("terminate called without an
    active exception", exit -6) while destroying leftover C++ distributed state. Seen in
    about 1 of 12 two-rank ``chipset train`` runs on a loaded host; it turns a finished,
    fully written run into a failed job. Nothing is left to clean up at this point.
    """
    _flush_stdio()
    os._exit(code)


def exit_process(code: object = 0) -> NoReturn:
    """End a command-line process (the ``chipset`` command, torchrun's agent) as ``sys.exit(code)``
    does, minus the interpreter's teardown of its modules.

    Everything an orderly exit owes is still done, in the interpreter's order: executors shut down
    and non-daemon threads joined, ``atexit`` functions run (logging's flush among them), stdout and stderr are
    flushed. What is skipped is freeing every module and object one by one: with torch loaded that
    took 0.6-0.7 s of CPU per process (2026-12-05), paid by the launcher and the agent of every job.
    """
    import atexit
    import threading

    # What the interpreter does first at exit: shut down concurrent.futures' executors (their
    # worker threads wait for work until told to stop; torch.compile leaves such pools), then
    # join the non-daemon threads. CPython's own function for it, called as the interpreter does
    # (from the main thread: the command's entry point and the agent's ``__main__``).
    threading._shutdown()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    _flush_stdio()
    os._exit(status)


def stop_fork_server(before: int | None) -> None:
    """Stop the multiprocessing fork server this process started (``before``: the server's pid
    before it was started, None where there was none) and reap it; its children are gone by now.

    Left alone, the server exits only after this process, as an orphan (a zombie in a container
    whose first process reaps nothing), after its interpreter's teardown of torch: 0.5 s of CPU
    for nothing, so it is killed. multiprocessing's resource tracker, started with it, exits with
    this process once its exit functions have released the semaphores it tracks.
    ``_forkserver_pid`` and ``_stop`` are CPython's own (3.8 to 3.14); where one is missing, the
    server exits after this process instead.
    """
    import signal
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if not pid or pid == before or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()


def release_fork_server_pipe() -> None:
    """In a child of a multiprocessing fork server: close the server's "alive" pipe, which the
    server hands each child (what tells the server its client is gone). Held by the child, it
    keeps the server, and so the child's parent-death signal, alive after the process that
    started the server is gone (even SIGKILLed). ``_forkserver_alive_fd`` is CPython's own;
    where it is missing nothing is closed."""
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None
