"""Which backend the test suite runs on, for this process and every process it starts.

The suite was written against cpu_sim (exact memory accounting, simulated device
profiles). Since the real ``cpu`` backend is installed too and automatic selection
prefers it, every test environment disables it unless the run asks for a backend:
``CHIPSET_BACKEND=cpu pytest tests/test_engine_parity.py`` runs those tests on ``cpu``.
The variable is read once, when the suite starts; tests that build a subprocess's
environment from scratch take their selection from :func:`clean_env`.
"""

from __future__ import annotations

import os

TEST_BACKEND = os.environ.get("CHIPSET_BACKEND", "").strip()
"""The backend the run asked for (empty: the default, cpu_sim by automatic selection)."""


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
    return e


def family_env(*paths: str) -> dict[str, str]:
    """:func:`clean_env` for a ``chipset train`` subprocess that imports a model family from
    ``paths`` (put first on PYTHONPATH, as a user's ``PYTHONPATH=. chipset train`` would), one
    thread per rank."""
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ":".join([*paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def chipset_train(run_dir, nproc: int, sets, *, env: dict[str, str], timeout: int = 600, cwd=None):
    """``chipset train --nproc N --run-dir DIR --set k=v ...`` as a subprocess (output captured)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", str(nproc),
                           "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
