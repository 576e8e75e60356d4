"""The conformance pytest plugin: backend option, fixtures, groups and the report.

Load it explicitly (``-p chipset.conformance.plugin``); it registers no entry point, so
no other pytest run is changed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from chipset.conformance import GROUPS

if TYPE_CHECKING:
    from chipset.loader import Backend

_OUTCOMES = ("passed", "failed", "skipped")


def pytest_addoption(parser) -> None:
    g = parser.getgroup("chipset-conformance")
    g.addoption("--chipset-backend", default=None, help="backend to certify (default: CHIPSET_BACKEND or the selected one)")
    g.addoption("--chipset-json-report", default=None, help="write the conformance JSON report to this file")
    g.addoption("--chipset-keep-going", action="store_true", default=False,
                help="run every check even when the work plan lists unimplemented methods")


class _Report:
    """Collects every test's group and outcome; prints the matrix and writes the JSON."""

    def __init__(self, backend: str, json_path: str | None = None):
        self.backend = backend
        self.json_path = json_path
        self.tests: dict[str, dict] = {}
        self.work_plan: list[dict[str, str]] = []
        """Methods the backend leaves unimplemented (NotImplementedError), each once."""
        self.held_back = 0
        """Checks not run because of the work plan."""

    def pytest_runtest_logreport(self, report) -> None:
        group = dict(report.user_properties).get("group", "?")
        if report.when == "call":
            outcome = "passed" if report.passed else "skipped" if report.skipped else "failed"
        elif report.failed:
            outcome = "error"
        elif report.skipped:
            outcome = "skipped"
        else:
            outcome = "passed"
        self.record(report.nodeid, group, outcome, _reason(report))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        d = self.to_dict()
        tr = terminalreporter
        tr.section(f"chipset conformance: {d['backend']}")
        if self.work_plan:
            self._write_plan(tr)
        tr.write_line(f"{'group':<14}{'passed':>8}{'failed':>8}{'skipped':>9}")
        for g, row in d["groups"].items():
            tr.write_line(f"{g:<14}{row['passed']:>8}{row['failed']:>8}{row['skipped']:>9}")
        s = d["summary"]
        tr.write_line(f"{'total':<14}{s['passed']:>8}{s['failed']:>8}{s['skipped']:>9}   errors: {s['errors']}")
        failed = [t for t in d["tests"] if t["outcome"] in ("failed", "error")]
        if failed:
            # One line per failing interface: how many, and the first failing assertion.
            tr.write_line("failures by group (first failing assertion):")
            for g in d["groups"]:
                mine = [t for t in failed if t["group"] == g]
                if mine:
                    first = mine[0]
                    why = (first["reason"] or first["outcome"]).splitlines()[0][:300]
                    tr.write_line(f"  {g}: {len(mine)} failed; first {first['id'].split('::', 1)[-1]}: {why}")
        skipped = [t for t in d["tests"] if t["outcome"] == "skipped"]
        if skipped:
            reasons = Counter((t["group"], t["reason"]) for t in skipped)
            tr.write_line("skip reasons:")
            for (g, why), n in sorted(reasons.items()):
                tr.write_line(f"  {g}: {n} x {why}")
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.json_path).write_text(json.dumps(d, indent=2))
            tr.write_line(f"JSON report: {self.json_path}")

    def _write_plan(self, tr) -> None:
        tr.write_line(f"work plan: {len(self.work_plan)} method(s) of {self.backend} raise NotImplementedError; "
                      "implement each (the docs section explains it):")
        width = max(len(f"{m['interface']}.{m['method']}") for m in self.work_plan) + 2
        for m in self.work_plan:
            tr.write_line(f"  {m['interface'] + '.' + m['method']:<{width}}{m['docs']}")
        if self.held_back:
            tr.write_line(f"{self.held_back} checks were not run: they would all fail on these methods. "
                          "Run them anyway with --keep-going (pytest: --chipset-keep-going).")

    def record(self, nodeid: str, group: str, outcome: str, reason: str) -> None:
        prev = self.tests.get(nodeid)
        # setup/call/teardown each report; the worst outcome wins.
        rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
        if prev is None or rank[outcome] > rank[prev["outcome"]]:
            self.tests[nodeid] = {"id": nodeid, "group": group, "outcome": outcome, "reason": reason}

    def to_dict(self) -> dict:
        summary = Counter(t["outcome"] for t in self.tests.values())
        groups = {g: dict.fromkeys(_OUTCOMES, 0) for g in GROUPS}
        for t in self.tests.values():
            row = groups.setdefault(t["group"], dict.fromkeys(_OUTCOMES, 0))
            row["failed" if t["outcome"] == "error" else t["outcome"]] += 1
        return {
            "backend": self.backend,
            "summary": {
                "passed": summary["passed"], "failed": summary["failed"],
                "skipped": summary["skipped"], "errors": summary["error"],
            },
            "groups": groups,
            "work_plan": self.work_plan,
            "tests": list(self.tests.values()),
        }


def _reason(report) -> str:
    if report.skipped:
        lr = report.longrepr
        if isinstance(lr, tuple) and len(lr) == 3:
            return str(lr[2]).removeprefix("Skipped: ")
        return str(lr)
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            return crash.message.strip()
        return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else "failed"
    return ""


def group_of(item) -> str:
    """A test's group: its module's name without ``test_``."""
    mod = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else item.nodeid
    return mod.removeprefix("test_")


def pytest_configure(config) -> None:
    from chipset.discovery.select import select
    from chipset.errors import BackendSelectionError

    name = config.getoption("--chipset-backend") or os.environ.get("CHIPSET_BACKEND") or None
    try:
        sel = select(name)
    except BackendSelectionError as exc:
        raise pytest.UsageError(f"chipset conformance cannot run: {exc}") from None
    # Ranks spawned by the collectives group must resolve the very same backend.
    os.environ["CHIPSET_BACKEND"] = sel.record.name
    config._chipset_report = _Report(sel.record.name, config.getoption("--chipset-json-report"))
    config.pluginmanager.register(config._chipset_report, "chipset-conformance-report")
    config.addinivalue_line("markers", "group(name): conformance group (set from the module name)")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        g = group_of(item)
        item.user_properties.append(("group", g))
        item.add_marker(pytest.mark.group(g))
    report = config._chipset_report
    report.work_plan = _work_plan(report.backend)
    if report.work_plan and items and not config.getoption("--chipset-keep-going"):
        # One list of what is missing instead of every check failing on the same stub.
        report.held_back = len(items)
        config.hook.pytest_deselected(items=list(items))
        items[:] = []


def pytest_collection_finish(session) -> None:
    """What exists once the checks are collected (torch, the backend, pytest's items) is moved out of
    the garbage collector's reach (``gc.freeze``): the checks that collect garbage to see a freed
    tensor's memory come back (memory group) then scan only what the checks made, not the whole
    interpreter (1.5 s of CPU for the memory group's 15 collections before, on a 2-core machine)."""
    import gc

    gc.collect()
    gc.freeze()


def _work_plan(name: str) -> list[dict[str, str]]:
    """The backend's unimplemented methods, probed once; [] when it cannot even be loaded
    for a reason other than NotImplementedError (the checks then report that error)."""
    import chipset
    from chipset.conformance._plan import unimplemented

    try:
        b = chipset.backend(name)
    except NotImplementedError as exc:
        return [{"interface": "hooks", "method": "load", "docs": "docs/writing-a-plugin.md §4 The hooks",
                 "error": str(exc).strip()}]
    except Exception:
        return []
    return unimplemented(b)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """An unfinished backend is not a pass, even though no check ran."""
    if session.config._chipset_report.work_plan and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- fixtures ------------------------------------------------------------------
@pytest.fixture(scope="session")
def backend_name(pytestconfig) -> str:
    """The name of the backend under test."""
    return pytestconfig._chipset_report.backend


@pytest.fixture(scope="session")
def backend(backend_name):
    """The loaded backend under test, bound to its device 0."""
    import chipset

    b = chipset.backend(backend_name)
    b.device.set_device(0)
    return b


@pytest.fixture(scope="session")
def caps(backend: Backend):
    """The backend's declared Capabilities."""
    return backend.capabilities


@pytest.fixture(scope="session")
def dev(backend: Backend):
    """The torch.device tensors of device 0 live on."""
    return backend.device.torch_device(0)
