"""The conformance suite can fail: deliberately broken backends, installed as a real
distribution (tests/broken_backends), are each failed in the right group and test; a
backend declaring fewer capabilities gets skips with reasons; cpu_sim passes every group
(in full: the tox env conformance-cpu_sim).
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import broken_backends
import pytest

import forked_cli
import testenv
from chipset.conformance import GROUPS
from testenv import SideBySide


def _suite(backend: str, tmp: Path, *extra: str, site: Path | None = None, plain_pytest: bool = False):
    env = testenv.clean_env()
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    report = tmp / f"{backend}.json"
    if plain_pytest:
        cmd = [sys.executable, "-m", "pytest", "-p", "chipset.conformance.plugin", "-p", "no:cacheprovider",
               "--pyargs", "chipset.conformance.tests", "--chipset-backend", backend,
               "--chipset-json-report", str(report), *extra]
    else:
        cmd = [sys.executable, "-m", "chipset.cli.main", "conformance", "--backend", backend,
               "--json-report", str(report), "-q", *extra]
    proc = forked_cli.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    data = json.loads(report.read_text()) if report.exists() else None
    return proc, data, tmp


def _outcomes(data) -> dict[str, str]:
    return {t["id"].split("::", 1)[1]: t["outcome"] for t in data["tests"]}


# variant, -k expression, group, tests that must fail, tests that must still pass. Each -k
# selects a few checks, so each run (and each collectives session) stays short.
_C = "test_collective"
CASES = [
    ("bad_allreduce", "all_reduce_sum-float32-37 or all_gather-float32-37 or all_reduce_sum-float32-0", "collectives",
     [f"{_C}[all_reduce_sum-float32-37]"], [f"{_C}[all_gather-float32-37]", f"{_C}[all_reduce_sum-float32-0]"]),
    ("stale_collective", "all_reduce_sum-float32-37", "collectives", [f"{_C}[all_reduce_sum-float32-37]"], []),
    ("bf16_as_fp16", "all_reduce_sum-bfloat16-37 or all_reduce_sum-float16-37", "collectives",
     [f"{_C}[all_reduce_sum-bfloat16-37]"], [f"{_C}[all_reduce_sum-float16-37]"]),
    ("int64_as_int32", "all_reduce_sum-int64-37", "collectives", [f"{_C}[all_reduce_sum-int64-37]"], []),
    ("bad_max", "all_reduce_max-float32-37", "collectives", [f"{_C}[all_reduce_max-float32-37]"], []),
    ("bad_avg", "all_reduce_avg-float32-37", "collectives", [f"{_C}[all_reduce_avg-float32-37]"], []),
    ("bad_allgather", "all_gather-float32-37", "collectives", [f"{_C}[all_gather-float32-37]"], []),
    ("bad_reduce_scatter", "reduce_scatter-float32-37", "collectives", [f"{_C}[reduce_scatter-float32-37]"], []),
    ("bad_broadcast", "broadcast-float32-37", "collectives", [f"{_C}[broadcast-float32-37]"], []),
    ("no_output_splits", "all_to_all_uneven-float32 or all_to_all-float32-37", "collectives",
     [f"{_C}[all_to_all_uneven-float32]"], [f"{_C}[all_to_all-float32-37]"]),
    ("bad_send_recv", "send_recv-float32-37", "collectives", [f"{_C}[send_recv-float32-37]"], []),
    ("bad_barrier", "barrier_waits", "collectives", [f"{_C}[barrier_waits_for_all]"], []),
    ("async_never_completes", "async_all_reduce", "collectives", [f"{_C}[async_all_reduce-float32]"], []),
    ("hang_timeout", "timeout_raises", "collectives", [f"{_C}[timeout_raises_collective_timeout_error]"], []),
    ("swallow_timeout", "timeout_raises", "collectives", [f"{_C}[timeout_raises_collective_timeout_error]"], []),
    ("bad_memory", "memory", "memory",
     ["test_float32_256_elements_adds_1024_bytes", "test_allocation_is_accounted_exactly[256]"],
     ["test_allocating_past_capacity_raises_chipset_oom"]),
    ("empty_cache_noop", "empty_cache", "memory", ["test_empty_cache_releases_cached_blocks"], []),
    ("reset_peak_noop", "peak", "memory", ["test_peak_tracks_the_maximum_and_resets"], []),
    ("bad_mem_info", "mem_get_info", "memory", ["test_mem_get_info_is_consistent"], []),
    ("bad_kernel", "forward_matches and swiglu or rms_norm-float32", "kernels",
     ["test_forward_matches_reference[swiglu-float32]"],
     ["test_forward_matches_reference[swiglu-bfloat16]", "test_forward_matches_reference[rms_norm-float32]"]),
    ("ignores_eps", "rms_norm", "kernels", ["test_argument_variants_match_reference[rms_norm-eps-float32]"],
     ["test_forward_matches_reference[rms_norm-float32]"]),
    ("ignores_mask", "argument_variants and sdpa", "kernels",
     ["test_argument_variants_match_reference[sdpa-scale-bool_mask-float32]",
      "test_argument_variants_match_reference[sdpa-additive_mask-float32]"],
     ["test_argument_variants_match_reference[sdpa-gqa-causal-fewer_queries-float32]"]),
    ("bad_grouped_mm", "forward_matches and grouped_mm-float32 or swiglu-float32", "kernels",
     ["test_forward_matches_reference[grouped_mm-float32]"], ["test_forward_matches_reference[swiglu-float32]"]),
    ("bad_grouped_mlp", "forward_matches and grouped_mlp-float32 or grouped_mm-float32", "kernels",
     ["test_forward_matches_reference[grouped_mlp-float32]"], ["test_forward_matches_reference[grouped_mm-float32]"]),
    ("bad_fp8_scale", "fp8_matmul and float32", "kernels",
     ["test_fp8_matmul_matches_exact_emulation[tensorwise-float32]",
      "test_fp8_matmul_matches_exact_emulation[rowwise-float32]"], []),
    ("bad_linear", "linear and float32", "kernels", ["test_linear_matches_reference[bias-float32]"],
     ["test_linear_matches_reference[no_bias-float32]"]),
    ("ignores_ignore_index", "argument_variants and cross_entropy", "kernels",
     ["test_argument_variants_match_reference[cross_entropy-ignore_index-sum-float32]"],
     ["test_argument_variants_match_reference[cross_entropy-none-default_ignore-float32]"]),
    ("bad_event", "streams", "streams",
     ["test_elapsed_time_is_positive_and_covers_the_interval"], ["test_elapsed_time_without_timing_raises"]),
    # Declared streams=True: the context check runs and fails, the defaults' checks still pass.
    ("bad_stream", "streams", "streams",
     ["test_stream_context_makes_it_current_and_restores"],
     ["test_stream_synchronize_and_query", "test_recorded_event_completes_after_synchronize"]),
    ("bad_probe", "discovery", "discovery",
     ["test_probe_does_not_initialise_the_device"],
     ["test_descriptor_import_pulls_in_no_vendor_sdk", "test_api_version_is_declared_and_compatible"]),
    ("ignores_visible", "visible", "device", ["test_visible_devices_variable_limits_the_device_count"], []),
    ("bad_device_index", "out_of_range", "device", ["test_out_of_range_index_raises_device_index_error[count]"], []),
    ("wrong_profile", "declared_profile or device_count_is_positive", "device",
     ["test_properties_match_a_declared_profile_of_the_same_name"], ["test_device_count_is_positive"]),
    # The same dropped contribution seen by training: every layout reduces gradients, partial
    # sums or losses with all_reduce, so each run's losses leave the one-device ones at step 1.
    ("bad_allreduce", "engine", "engine",
     ["test_losses_equal_one_device[dp2]", "test_losses_equal_one_device[tp2]",
      "test_losses_equal_one_device[pp2_1f1b]", "test_losses_equal_one_device[ep2]"],
     []),
]


# What the verdict must say, where the wording is the point (a hang is named, not "exited with -9").
MESSAGES = {
    "hang_timeout": "collective all_reduce on rank 0 did not raise CollectiveTimeoutError within 3 s",
    "swallow_timeout": "completed instead of timing out",
    "stale_collective": "call 2",
    "no_output_splits": "output splits",
}


# Every suite run this file makes, by the test that checks it: (backend, extra arguments,
# whether it needs the broken backends' site, plain pytest instead of the CLI).
_EVERY_GROUP = "not test_engine and not test_collectives or dp2 or all_reduce_sum-float32-37"
RUNS = {
    **{f"{c[0]}-{c[2]}": (c[0], ("-k", c[1]), True, False) for c in CASES},
    "few_caps": ("few_caps", (), True, False),
    # Every group, with the slow ones cut to one check each: the whole suite against cpu_sim
    # is the tox env conformance-cpu_sim, so it is not run a second time here.
    "cpu_sim": ("cpu_sim", ("--junit-xml", "junit.xml", "-k", _EVERY_GROUP), False, False),
    "plain_pytest": ("cpu_sim", ("-q", "-k", "rng"), False, True),
    "cuda": ("cuda", (), False, False),
    "nosuchchip": ("nosuchchip", (), False, False),
}
_TEST_RUN = {"test_backend_with_fewer_capabilities_gets_skips_with_reasons_not_failures": "few_caps",
             "test_cpu_sim_passes_every_group_with_json_and_junit": "cpu_sim",
             "test_plain_pytest_invocation_is_equivalent": "plain_pytest",
             "test_absent_hardware_is_reported_clearly_and_is_not_a_pass": "cuda",
             "test_unknown_backend_lists_the_installed_ones": "nosuchchip"}
# Why the runs go side by side: most of a run is waiting (on a peer rank, a collective
# timeout, a watchdog; bad_send_recv's rank 0 waits out the session's 30 s timeout), so a
# few at once finish the file in about half the time on 2 cores. The slowest start first.
_SIDE_BY_SIDE = 4
_SLOW_FIRST = ("bad_send_recv-collectives", "hang_timeout-collectives", "few_caps", "cpu_sim",
               "async_never_completes-collectives", "swallow_timeout-collectives", "bad_allreduce-engine")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs this session's selected tests of this file check, started side by side
    (testenv.SideBySide): {run: (CompletedProcess, JSON report, run directory)}."""
    wanted = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        if item.originalname == "test_broken_backend_fails_in_the_right_group":
            wanted.add(item.callspec.id)
        elif item.originalname in _TEST_RUN:
            wanted.add(_TEST_RUN[item.originalname])
    site = broken_backends.install(tmp_path_factory.mktemp("broken-site"))
    order = [k for k in _SLOW_FIRST if k in wanted] + sorted(wanted.difference(_SLOW_FIRST))

    def job(key):
        backend, extra, broken, plain = RUNS[key]
        tmp = tmp_path_factory.mktemp(key.replace("-", "_"))
        return lambda: _suite(backend, tmp, *extra, site=site if broken else None, plain_pytest=plain)

    started = SideBySide({key: job(key) for key in order}, width=_SIDE_BY_SIDE)
    yield started
    started.close()


def test_every_broken_backend_has_a_case_naming_the_check_that_fails_it():
    defects = broken_backends.defects()
    assert len(defects) >= 25
    covered = {c[0] for c in CASES if c[3]}
    assert set(defects) == covered, f"without a case: {sorted(set(defects) - covered)}"


@pytest.mark.parametrize(("variant", "keyword", "group", "must_fail", "must_pass"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_broken_backend_fails_in_the_right_group(runs, variant, keyword, group, must_fail, must_pass):
    proc, data, _ = runs[f"{variant}-{group}"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert data is not None and data["backend"] == variant
    assert data["summary"]["failed"] > 0
    assert data["groups"][group]["failed"] > 0
    other_failures = {g: row["failed"] for g, row in data["groups"].items() if g != group and row["failed"]}
    assert not other_failures, f"{variant} failed outside {group}: {other_failures}"
    outcome = _outcomes(data)
    for name in must_fail:
        assert outcome.get(name) == "failed", f"{name}: {outcome.get(name)}"
    if variant in MESSAGES and group == "collectives":
        reason = next(t["reason"] for t in data["tests"] if t["id"].endswith("::" + must_fail[0]))
        assert MESSAGES[variant] in reason, reason
    for name in must_pass:
        assert outcome.get(name) == "passed", f"{name}: {outcome.get(name)}"
    assert "chipset conformance: " + variant in proc.stdout  # the printed matrix
    assert f"  {group}: " in proc.stdout.split("failures by group", 1)[-1]  # the grouped summary


def test_backend_with_fewer_capabilities_gets_skips_with_reasons_not_failures(runs):
    proc, data, _ = runs["few_caps"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = data["summary"]
    assert s["failed"] == 0 and s["errors"] == 0 and s["skipped"] > 50 and s["passed"] > 50
    reasons = {t["reason"] for t in data["tests"] if t["outcome"] == "skipped"}
    assert all(r.startswith("backend does not declare") for r in reasons), reasons
    for needle in ("capability streams", "capability event_timing", "collective broadcast",
                   "collective dtype bfloat16", "AMP dtype bfloat16", "dtype float16"):
        assert any(needle in r for r in reasons), f"no skip mentions {needle!r}: {sorted(reasons)}"
    assert "skip reasons:" in proc.stdout


def test_cpu_sim_passes_every_group_with_json_and_junit(runs):
    proc, data, tmp = runs["cpu_sim"]
    junit = tmp / "junit.xml"
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert set(data) == {"backend", "summary", "groups", "work_plan", "tests"}
    assert data["backend"] == "cpu_sim" and data["work_plan"] == []
    s = data["summary"]
    assert set(s) == {"passed", "failed", "skipped", "errors"}
    assert s["failed"] == 0 and s["errors"] == 0
    assert s["passed"] >= 120, s
    assert list(data["groups"]) == list(GROUPS)
    for group, row in data["groups"].items():
        assert set(row) == {"passed", "failed", "skipped"}
        assert row["passed"] > 0, f"group {group} is empty"
    assert all(set(t) == {"id", "group", "outcome", "reason"} for t in data["tests"])
    root = ET.parse(junit).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == len(data["tests"])
    groups = {p.get("value") for p in root.iter("property") if p.get("name") == "group"}
    assert groups == set(GROUPS)


def test_plain_pytest_invocation_is_equivalent(runs):
    proc, data, _ = runs["plain_pytest"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["groups"]["rng"]["passed"] >= 6 and data["summary"]["failed"] == 0


def test_absent_hardware_is_reported_clearly_and_is_not_a_pass(runs):
    proc, data, _ = runs["cuda"]
    assert proc.returncode == 2
    assert "cuda" in proc.stderr and "unavailable" in proc.stderr and "cpu_sim" in proc.stderr
    assert data is None


def test_unknown_backend_lists_the_installed_ones(runs):
    proc, _, _ = runs["nosuchchip"]
    assert proc.returncode == 2
    assert "nosuchchip" in proc.stderr and "cpu_sim" in proc.stderr
