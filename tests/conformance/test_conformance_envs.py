"""The whole conformance suite against every backend this machine can certify: cpu_sim, cpu, and
chipset-ascend and chipset-accelerator on their test doubles (tests/conformance_envs.py, which
tox's `conformance` env also runs alone). Here the four suites run side by side inside the test
session, so their waiting (on ranks, deliberate collective timeouts, watchdogs) overlaps the
other test files instead of adding a tox env after them.
"""

from __future__ import annotations

import json

import conformance_envs
import pytest

import testenv

pytestmark = pytest.mark.multirank  # each suite's collectives group starts a world of ranks


@pytest.fixture(scope="module")
def suites(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance")
    env = testenv.clean_env()
    env.pop("CHIPSET_DISABLE_PLUGINS", None)  # the suites name their backends; none is disabled
    names = [name for name in testenv.selected(request, test_the_backend_passes_the_whole_conformance_suite) if name]
    started = testenv.SideBySide({name: (lambda name=name: conformance_envs.run_suite(name, out, env)) for name in names},
                                 width=len(conformance_envs.SUITES))
    yield started
    started.close()


@pytest.mark.parametrize("suite", list(conformance_envs.SUITES))
def test_the_backend_passes_the_whole_conformance_suite(suites, suite):
    code, report, log = suites[suite]
    assert code == 0, _why(report, log)
    data = json.loads(report.read_text())
    assert data["summary"]["failed"] == 0 and data["summary"]["errors"] == 0, _why(report, log)
    assert data["summary"]["passed"] > 200, data["summary"]  # the whole suite ran, not a slice


def _why(report, log: str) -> str:
    """The first failing checks' reasons (a list of 141 failed names says nothing), then the log's end."""
    if not report.exists():
        return log[-4000:]
    failed = [t for t in json.loads(report.read_text())["tests"] if t["outcome"] in ("failed", "error")]
    return "\n".join(f"{t['id']}: {t['reason'][:1200]}" for t in failed[:3]) + "\n...\n" + log[-1500:]
