"""Which backend the test suite runs on, for this process and every process it starts.

The suite was written against cpu_sim (exact memory accounting, simulated device
profiles). Since the real ``cpu`` backend is installed too and automatic selection
prefers it, every test environment disables it unless the run asks for a backend:
``CHIPSET_BACKEND=cpu pytest tests/runtime/test_engine_parity.py`` runs those tests on ``cpu``.
The variable is read once, when the suite starts; tests that build a subprocess's
environment from scratch take their selection from :func:`clean_env`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TEST_BACKEND = os.environ.get("CHIPSET_BACKEND", "").strip()
"""The backend the run asked for (empty: the default, cpu_sim by automatic selection)."""

TINY_RUN = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": 8, "global_batch": 4, "seq_len": 16, "lr": 1e-2, "seed": 7},
}
"""A one-process run of the built-in transformer small enough for a unit test (8 steps)."""

TESTS = Path(__file__).resolve().parent
"""The suite's folder: its helper modules; the test files are in its rooms, tests/<room>/."""


def selection_env() -> dict[str, str]:
    """The variables that pin the suite's backend."""
    if TEST_BACKEND:
        return {"CHIPSET_BACKEND": TEST_BACKEND}
    return {"CHIPSET_DISABLE_PLUGINS": "cpu"}


def clean_env(*, keep_settings: bool = False) -> dict[str, str]:
    """This process's environment without chipset's variables (``keep_settings``: without the
    selection variables only), plus the suite's selection."""
    drop = ("CHIPSET_BACKEND", "CHIPSET_DISABLE_PLUGINS")
    e = {k: v for k, v in os.environ.items()
         if not (k in drop if keep_settings else k.startswith("CHIPSET_"))}
    e.update(selection_env())
    # One intra-op thread per process unless a test asks for more: the suite's processes share two
    # cores, and OpenMP threads that outnumber the cores left to them spend their CPU spinning.
    e.setdefault("OMP_NUM_THREADS", "1")
    # The suite's helper modules (testenv, multirank, ...) live in tests/, the test files in its
    # rooms (tests/<room>/): a test file run as a script or a rank imports them from here.
    e["PYTHONPATH"] = os.pathsep.join([*([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []), str(TESTS)])
    return e


def family_env(*paths: str) -> dict[str, str]:
    """:func:`clean_env` for a ``chipset train`` subprocess that imports a model family from
    ``paths`` (put first on PYTHONPATH, as a user's ``PYTHONPATH=. chipset train`` would), one
    thread per rank."""
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ":".join([*paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def fresh_python(code: str, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter (nothing this test process imported is loaded there) and
    return its stdout; a non-zero exit fails the test with its stderr."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def compiler_modules_after(code: str) -> list[str]:
    """torch's compiler modules (dynamo, inductor) a fresh interpreter has loaded after ``code``:
    each costs about a second of CPU and 100 MiB in every process that imports it."""
    out = fresh_python(code + "\nimport sys\n"
                       "print(','.join(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n")
    return [m for m in out.strip().split(",") if m]


def chipset_train(run_dir, nproc: int, sets, *, env: dict[str, str], timeout: int = 600, cwd=None):
    """``chipset train --nproc N --run-dir DIR --set k=v ...`` as a subprocess (output captured)."""
    import forked_cli

    return forked_cli.run([*forked_cli.CLI, "train", "--nproc", str(nproc),
                           "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


# --------------------------------------------------------------------------------------
# Jobs side by side
# --------------------------------------------------------------------------------------

SIDE_BY_SIDE = 2
"""Jobs a test file runs at once. Much of a small job is waiting (torchrun's rendezvous and
monitoring, ranks waiting on each other, a restart, a timeout, process exit): two 2-rank
``chipset train`` runs side by side took 8.5 s where one after the other took 11.8 s, on 2
shared cores. Wider only contends, except for jobs that mostly wait (the conformance self-test)."""


def selected(request, test) -> list[str]:
    """The parameter ids of ``test`` (a test function of the requesting module) that this
    session runs, ``[""]`` for an unparametrized one, ``[]`` when it is deselected: a
    module-scoped fixture starts only the jobs of the tests that will check them."""
    out = []
    for item in request.session.items:
        if item.module is request.module and getattr(item, "originalname", item.name) == test.__name__:
            if any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True) for m in item.iter_markers()):
                continue  # skipped by a mark: its job would be for nothing
            callspec = getattr(item, "callspec", None)
            out.append(callspec.id if callspec is not None else "")
    return out


CURRENT_TEST: dict = {"item": None}
"""The test running now (set by conftest.py)."""
JOB_OWNER = threading.local()
"""In a SideBySide job's thread: ``.item``, the test that started the job. conftest.py's
multirank guard judges the processes a job starts by that test, not by whichever test runs
when they start."""


class SideBySide:
    """Start zero-argument callables (each starts a job and waits for it) ``SIDE_BY_SIDE`` at a
    time, in the order given; ``[key]`` waits for that one's result (or raises its exception).
    Create it in a fixture of the tests that check the jobs: they own the jobs (JOB_OWNER)."""

    def __init__(self, jobs: dict, width: int = SIDE_BY_SIDE):
        from concurrent.futures import ThreadPoolExecutor

        owner = CURRENT_TEST["item"]

        def owned(job):
            JOB_OWNER.item = owner
            try:
                return job()
            finally:
                JOB_OWNER.item = None

        self._pool = ThreadPoolExecutor(max_workers=width)
        self._futures = {key: self._pool.submit(owned, job) for key, job in jobs.items()}

    def __getitem__(self, key):
        return self._futures[key].result()

    def __contains__(self, key) -> bool:
        return key in self._futures

    def close(self) -> None:
        """Waits for the jobs still running; drops those not started."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def starts_ranks(args, env) -> bool:
    """Whether a command starts several ranks: torchrun, ``--nproc N`` with N > 1, or WORLD_SIZE > 1 (conftest.py's multirank guard)."""
    cmd = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if any(a == "torch.distributed.run" or a.endswith("torchrun") for a in cmd):
        return True
    for flag, value in zip(cmd, cmd[1:], strict=False):
        if flag in ("--nproc", "--nproc-per-node", "--nproc_per_node") and value.isdigit() and int(value) > 1:
            return True
    return bool(env) and str(env.get("WORLD_SIZE", "1")).isdigit() and int(env.get("WORLD_SIZE", "1")) > 1


def refuse_unmarked_ranks(args, env) -> None:
    """conftest.py's multirank guard: raise if the running test (or the SideBySide job's owner:
    a job is the test's that started it, even while a later test runs) is not marked multirank
    and ``args`` starts several ranks."""
    item = getattr(JOB_OWNER, "item", None) or CURRENT_TEST["item"]
    if item is not None and item.get_closest_marker("multirank") is None and starts_ranks(args, env):
        raise RuntimeError(f"{item.nodeid} starts several ranks ({args!r}) but is not marked multirank: "
                           "add @pytest.mark.multirank (the fast tier, -m 'not multirank', must start none)")

def is_agent(pid: int) -> bool:
    """Whether process ``pid`` is a torchrun agent as chipset starts it: forked from the launcher
    (its command line the launcher's; torch's agent names the process ``pt_elastic``, train/agent.py),
    or ``python -m chipset.train.agent`` / torchrun."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "pt_elastic":
            return True
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"multiprocessing.forkserver" in cmdline:  # the agent's fork server and its ranks name the module
        return False
    return b"chipset.train.agent" in cmdline or b"torch.distributed.run" in cmdline
