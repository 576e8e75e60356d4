"""Shared fixtures: a site directory for real plugin distributions, and a clean selection state."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import testenv
from chipset.discovery import records

ROOT = Path(__file__).resolve().parents[1]

# The suite's backend for the whole session, module-scoped fixtures included (they run
# before the per-test fixture below): tests/testenv.py.
os.environ.pop("CHIPSET_BACKEND", None)
os.environ.pop("CHIPSET_DISABLE_PLUGINS", None)
os.environ.update(testenv.selection_env())

# Under pytest-xdist, each worker's own computing gets its share of the cores (tox: three workers on
# a 2-core machine, one thread each), not one thread per core: OpenMP threads that outnumber the
# cores left to them spend their CPU spinning.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _import_triton_interpreted() -> None:
    """Import triton under its interpreter before any test module can import it compiled.

    Triton picks interpreter or compiler when ``triton.language`` is first imported; the kernel
    tests (tests/plugins/test_cuda_triton.py) need the interpreter, and test modules collected
    before them import triton compiled through transformers and torch. Nothing else in the suite
    launches a Triton kernel in this process (tests/plugins/test_cuda_triton_compile.py compiles
    in a subprocess of its own).
    """
    import importlib.util

    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_interpreted()


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
    modes = torch._C._len_torch_dispatch_stack()
    yield
    records.clear_cache()
    # A test that leaves a dispatch mode on (a device bound in this process and never released)
    # changes every later test in this worker: fail it here, not a stranger later.
    assert torch._C._len_torch_dispatch_stack() == modes, (
        "this test left a torch dispatch mode active (a backend device set in the pytest process "
        "and never released: call backend.device.release() or chipset.train.rank.stop)")


def run_cli(*args: str, env: dict | None = None, site: Path | None = None, timeout: float = 120):
    """Run ``chipset ARGS`` in a process of its own (tests/forked_cli.py); returns CompletedProcess with text output."""
    e = testenv.clean_env()
    if site is not None:
        e["PYTHONPATH"] = os.pathsep.join([str(site), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(env or {})
    return forked_cli.run([*forked_cli.CLI, *args], capture_output=True, text=True, env=e, timeout=timeout)


# --------------------------------------------------------------------------------------
# The `multirank` marker: tests that start several processes
# --------------------------------------------------------------------------------------

# What starting ranks looks like in this suite's sources: the multirank helper's jobs, the
# CLI with --nproc, torchrun itself, torch's multiprocessing spawn, ranks started by hand
# with WORLD_SIZE, or the conformance suite (its collective checks start a world of ranks). Tests that start ranks through another module (tests/ cannot see into it)
# carry an explicit @pytest.mark.multirank. A false positive only moves a test to the slow tier.
_MULTIRANK = re.compile(r"run_jobs\(|--nproc|torch\.distributed\.run|\btorchrun\b[^_]|"
                        r"\.spawn\(|start_processes\(|NPROC\b|WORLD_SIZE=[\"']?[2-9]|"
                        r"\"conformance\", \"--backend\"|chipset conformance")


def _suite_function(obj, mod) -> bool:
    """Whether ``obj`` is the test module's own function or one it imported from a helper
    module of this folder or a test file of its rooms (testenv, parity, test_hf, ...): the scan follows those, not chipset's."""
    if obj.__module__ == mod.__name__:
        return True
    try:
        return Path(inspect.getsourcefile(obj)).resolve().is_relative_to(Path(__file__).resolve().parent)
    except TypeError:
        return False


def _sources(item) -> str:
    """The test's source, its fixtures' sources, and the module functions they name (to a fixpoint).

    Why a source scan: a multi-rank test may start its ranks in a module-scoped fixture or
    a helper a few calls down, and the marker must follow it there without a hand-kept list.
    """
    mod = item.module
    funcs = [item.function]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        funcs += [d.func for d in defs]
    seen, texts = set(), []
    while funcs:
        f = funcs.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            text = inspect.getsource(f)
        except (OSError, TypeError):
            continue
        texts.append(text)
        for name, obj in vars(mod).items():
            if inspect.isfunction(obj) and _suite_function(obj, mod) and re.search(rf"\b{name}\(", text):
                funcs.append(obj)
    # Parametrized commands (e.g. the docs' console examples) carry their --nproc in a parameter.
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        texts.append(repr(callspec.params))
    return "\n".join(texts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multirank") is None and _MULTIRANK.search(_sources(item)):
            item.add_marker(pytest.mark.multirank)


# A guard so the fast tier provably starts no ranks: while an unmarked test runs (its
# fixtures included), launching torchrun, the CLI with --nproc > 1, or a process with
# WORLD_SIZE > 1 fails that test with what to do.
_current = testenv.CURRENT_TEST  # the running test, also read by testenv.SideBySide


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["item"] = item
    yield
    _current["item"] = None


def pytest_configure(config):
    orig = subprocess.Popen.__init__
    if getattr(orig, "_multirank_guard", False):
        return

    def guarded(self, args, *a, **kw):
        testenv.refuse_unmarked_ranks(args, kw.get("env"))
        orig(self, args, *a, **kw)

    guarded._multirank_guard = True
    subprocess.Popen.__init__ = guarded
