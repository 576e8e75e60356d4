"""Shared fixtures: a site directory for real plugin distributions, and a clean selection state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import testenv
from chipset.discovery import records

ROOT = Path(__file__).resolve().parents[1]

# The suite's backend for the whole session, module-scoped fixtures included (they run
# before the per-test fixture below): tests/testenv.py.
os.environ.pop("CHIPSET_BACKEND", None)
os.environ.pop("CHIPSET_DISABLE_PLUGINS", None)
os.environ.update(testenv.selection_env())


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh site directory on sys.path; plugins written there are discovered for real."""
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    records.clear_cache()
    yield d
    records.clear_cache()
    for mod in [m for m in sys.modules if m.startswith("plugin_")]:
        del sys.modules[mod]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("CHIPSET_BACKEND", "CHIPSET_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    # The suite's backend (tests/testenv.py): cpu_sim unless the run named another.
    for var, value in testenv.selection_env().items():
        monkeypatch.setenv(var, value)
    records.clear_cache()
    yield
    records.clear_cache()


def run_cli(*args: str, env: dict | None = None, site: Path | None = None, timeout: float = 120):
    """Run ``chipset ARGS`` in a subprocess; returns CompletedProcess with text output."""
    e = testenv.clean_env()
    if site is not None:
        e["PYTHONPATH"] = os.pathsep.join([str(site), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "chipset.cli.main", *args],
        capture_output=True, text=True, env=e, timeout=timeout,
    )
