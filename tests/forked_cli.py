"""``python -m chipset.cli.main ARGS`` as a fork of a server that has imported torch once.

A fresh interpreter running the CLI spends about 1.5 s of CPU importing torch before it reads
its arguments (2026-12-06, this 2-core machine), and the suite runs the CLI about 300 times:
some 450 CPU-s, a sixth of the whole suite. :func:`run` takes the arguments of
``subprocess.run`` and, for a command that is ``[sys.executable, "-m", "chipset.cli.main",
...]``, forks the process from a multiprocessing fork server (one per pytest worker) that
imported torch and chipset's CLI with the suite's clean environment. Any other command, or
arguments it does not handle (``input``, output not captured), go to ``subprocess.run``.

The child is what the interpreter would be: the given environment, working directory and
import path (the current directory first unless ``PYTHONSAFEPATH``, then ``PYTHONPATH``, then
the interpreter's own), the module run as ``__main__``, stdin from /dev/null, stdout and stderr
to files, exit functions run, the exit code of ``SystemExit`` (a message printed, exit 1) or 1
with the traceback. What differs: its parent is the fork server, and torch and ``chipset.cli``
were imported before the environment was set (neither reads a variable the suite changes at
import; OpenMP's thread count, read as torch loads, is set again from ``OMP_NUM_THREADS``).
Tests about the interpreter itself (its import path at start, the console script, signals sent
to the CLI's own process) start it with ``subprocess`` as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading

CLI = [sys.executable, "-m", "chipset.cli.main"]
# What the server imports once for every run it forks: torch, the CLI, torchrun's launcher, and what
# most training runs import on their own (torch.distributed.checkpoint, which brings DTensor and
# sympy, for the last step's checkpoint; torch.utils.tensorboard for the default metrics sink):
# about 0.65 s of CPU a run on a 2-core machine (2026-12-06). Nothing here reads chipset's variables.
_PRELOAD = ["torch", "chipset.cli.main", "torch.distributed.run", "torch.distributed.checkpoint",
            "torch.utils.tensorboard", "forked_cli"]
_state: dict = {}
# multiprocessing's Process is not thread-safe in one way the suite meets: ``Process.start`` first
# polls every child it started before (``multiprocessing.process._cleanup``), so a thread starting a
# run could read the exit code of another thread's run at the moment that thread read it. The fork
# server writes the code once, so one reader got it and the other got end-of-file, which
# multiprocessing reports as exit code 255 (a conformance run in tests/conformance exited "255"
# once in about 150 full runs of the suite; four threads forking 600 short children without this
# lock got 85 of them, 2026-12-07). Every start and every read of an exit code holds it; waiting
# for a run to end does not.
_exit_lock = threading.Lock()


def _child(target: tuple[str, str], argv: list[str], env: dict, cwd: str, base_path: list[str], out: str,
           err: str | None) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` (``target`` ("module", MODULE)) or ``python
    SCRIPT ARGV`` (("script", SCRIPT)) and exit with its code."""
    import atexit
    import runpy
    import traceback

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if err else fd, 2)
    os.environ.clear()
    os.environ.update(env)
    _threads(env)
    os.chdir(cwd)
    kind, name = target
    head = [] if env.get("PYTHONSAFEPATH") else [os.getcwd() if kind == "module" else os.path.dirname(name)]
    sys.path[:] = head + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + base_path
    sys.argv = [name, *argv]
    if kind == "module":
        sys.modules.pop(name, None)  # imported by the server; ``python -m`` runs it before any import
    code: object = 0
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _threads(env: dict) -> None:
    """The intra-op thread count a new interpreter with ``env`` would have. OpenMP read
    ``OMP_NUM_THREADS`` when the server imported torch (the suite's clean environment, which
    leaves it unset: one thread per core), so a run whose environment sets it gets it here.
    Without this, a run given ``OMP_NUM_THREADS=1`` computed on two threads that, on a loaded
    2-core machine, spent most of their CPU spinning: a 15-step GRPO run took 13.0 s of CPU
    instead of 4.4 (2026-12-06)."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _context():
    """The fork server's context, started on first use with the suite's clean environment."""
    if "ctx" not in _state:
        import json
        import multiprocessing
        import multiprocessing.forkserver

        import testenv

        clean = _state["env"] = testenv.clean_env()
        bare = {k: v for k, v in clean.items() if k != "PYTHONPATH"}
        # The interpreter's own import path (stdlib, site-packages, editable installs), without
        # the entries pytest or PYTHONPATH add.
        _state["base"] = json.loads(subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True, text=True, env=bare, check=True).stdout)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(clean)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _state["ctx"] = ctx
    return _state["ctx"]


MODULES = ("chipset.cli.main", "torch.distributed.run")
"""The modules :func:`run` forks (``python -m MODULE``): the CLI, and torchrun for tests/multirank.py's jobs."""


def target(cmd) -> tuple[str, str] | None:
    """("module", M) for ``[sys.executable, "-m", M, ...]`` with M in MODULES, else None."""
    if isinstance(cmd, list) and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in MODULES:
        return ("module", cmd[2])
    return None


# Variables an interpreter or torch reads as it starts, before the child could set them; the
# server started with the suite's clean environment, so a run that changes one needs its own.
_AT_START = ("PYTHON", "TORCH", "LD_", "MALLOC_", "TRITON_")
_SET_LATER = {"PYTHONPATH", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}


def forkable(env: dict | None) -> bool:
    """Whether a forked child can be what a new interpreter with ``env`` would be: no start-time
    variable differs from the server's, and no ``PYTHONPATH`` folder holds a ``sitecustomize``
    (a test double's start-up hook, tests/doubles/)."""
    if env is None:
        return True
    _context()
    server = _state["env"]
    for key in set(env) | set(server):
        if key.startswith(_AT_START) and key not in _SET_LATER and env.get(key) != server.get(key):
            return False
    return not any(os.path.exists(os.path.join(p, name)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
                   for name in ("sitecustomize.py", "usercustomize.py"))


class Forked:
    """A command forked from the server, as much of ``subprocess.Popen`` as the suite uses: ``pid``,
    ``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``. Its stdout (and stderr, or its own
    ``err`` file) go to the file ``out``."""

    def __init__(self, cmd: list[str], what: tuple[str, str], argv: list[str], *, env: dict | None, cwd, out: str,
                 err: str | None = None):
        import testenv

        testenv.refuse_unmarked_ranks(cmd, env)
        ctx = _context()
        self.args = cmd
        self._proc = ctx.Process(target=_child, args=(what, argv, dict(os.environ if env is None else env),
                                                      os.path.abspath(cwd or os.getcwd()), _state["base"], out, err))
        with _exit_lock:
            self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        with _exit_lock:
            return self._proc.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        from multiprocessing.connection import wait

        wait([self._proc.sentinel], timeout)  # the sentinel is readable once the exit code is
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def popen(cmd, *, log, env: dict | None = None, cwd=None):
    """``subprocess.Popen(cmd, ...)`` with stdout and stderr to the file ``log``, forked from the
    server where it can be (module docstring): a :class:`Forked` or a ``subprocess.Popen``."""
    cmd = [str(c) for c in cmd]
    what = target(cmd)
    if what is None or not forkable(env):
        with open(log, "w") as f:
            return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    return Forked(cmd, what, cmd[3:], env=env, cwd=cwd, out=str(log))


def run(cmd, *, env: dict | None = None, cwd=None, timeout: float | None = None, capture_output: bool = False,
        text: bool = False, stdout=None, stderr=None, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)``, forked from the server where it can be (module docstring)."""
    cmd = [str(c) for c in cmd] if isinstance(cmd, (list, tuple)) else cmd
    captured = capture_output or (stdout == subprocess.PIPE and stderr in (subprocess.PIPE, subprocess.STDOUT))
    what = target(cmd)
    if what is None or kwargs or not captured or not forkable(env):
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output, text=text,
                              stdout=stdout, stderr=stderr, check=check, **kwargs)
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
        out = os.path.join(tmp, "out")
        err = None if stderr == subprocess.STDOUT else os.path.join(tmp, "err")
        proc = Forked(cmd, what, cmd[3:], env=env, cwd=cwd, out=out, err=err)
        try:
            proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()

        def read(path):
            if path is None or not os.path.exists(path):
                return None
            with open(path, "rb") as f:
                data = f.read()
            return data.decode() if text else data

        output, errors = read(out), read(err)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=output, stderr=errors)
    result = subprocess.CompletedProcess(cmd, proc.returncode, output, errors)
    if check:
        result.check_returncode()
    return result
