"""Discovery of real installed plugin distributions: statuses, isolation, API negotiation."""

from __future__ import annotations

import warnings

import pytest

import chipset
from chipset.discovery import ChipsetPluginWarning, discover
from chipset.errors import PluginValidationError
from plugin_factory import make_plugin


def _by_name():
    return {r.name: r for r in discover(refresh=True)}


def test_builtin_plugins_are_discovered_with_distribution_and_version():
    recs = _by_name()
    assert {"cpu_sim", "cuda", "ascend"} <= set(recs)
    sim = recs["cpu_sim"]
    assert sim.status == "ok"
    assert sim.distribution == "chipset-cpu-sim"
    assert sim.version
    assert sim.api_version == "1.0"
    assert sim.entry_point == "cpu_sim = chipset_cpu_sim:descriptor"


def test_hardware_plugins_report_unavailable_with_a_reason_on_this_machine():
    recs = _by_name()
    for name in ("cuda", "ascend"):
        assert recs[name].status == "unavailable"
        assert len(recs[name].reason) > 10


def test_good_third_party_plugin_is_ok_and_loads(site):
    make_plugin(site, "acme", priority=10)
    rec = _by_name()["acme"]
    assert (rec.status, rec.distribution, rec.priority) == ("ok", "chipset-acme", 10)
    b = chipset.backend("acme")
    assert b.name == "acme"
    assert b.capabilities.kernels == ("swiglu",)  # filled from what the plugin registered


def test_plugin_whose_import_raises_is_isolated_and_warned(site):
    make_plugin(site, "broken", module_prelude="raise ImportError('vendor SDK libfoo.so not found')")
    with pytest.warns(ChipsetPluginWarning, match="broken"):
        recs = _by_name()
    assert recs["broken"].status == "import-error"
    assert "libfoo.so" in recs["broken"].reason
    assert "Traceback" in recs["broken"].traceback
    assert recs["cpu_sim"].status == "ok"
    assert chipset.backend("cpu_sim").name == "cpu_sim"


def test_plugin_whose_probe_raises_is_isolated(site):
    make_plugin(site, "flaky", probe_body="raise RuntimeError('driver exploded')")
    with pytest.warns(ChipsetPluginWarning):
        rec = _by_name()["flaky"]
    assert rec.status == "probe-error"
    assert "driver exploded" in rec.reason


@pytest.mark.parametrize(
    ("version", "needle"),
    [((2, 0), "different major"), ((1, 9), "upgrade chipset"), ((0, 3), "different major")],
)
def test_incompatible_api_versions_are_refused_with_reason(site, version, needle):
    make_plugin(site, "future", api_version=version)
    rec = _by_name()["future"]
    assert rec.status == "incompatible-api"
    assert needle in rec.reason


def test_entry_point_that_is_not_a_descriptor_is_an_import_error(site):
    make_plugin(site, "odd", entry_value="plugin_odd:_probe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = _by_name()["odd"]
    assert rec.status == "import-error"
    assert "BackendDescriptor" in rec.reason


def test_disable_plugins_by_name_or_distribution(site, monkeypatch):
    make_plugin(site, "acme")
    monkeypatch.setenv("CHIPSET_DISABLE_PLUGINS", "chipset-acme, cuda")
    recs = _by_name()
    assert recs["acme"].status == "disabled"
    assert recs["cuda"].status == "disabled"
    assert recs["cpu_sim"].status == "ok"


def test_hooks_outside_the_spec_fail_at_load_quoting_the_hook(site):
    bad = "from chipset.discovery.hookspecs import hookimpl\n\n@hookimpl\ndef chipset_devise():\n    return None\n"
    make_plugin(site, "typo", hooks=bad)
    with pytest.raises(PluginValidationError, match="chipset_devise"):
        chipset.backend("typo")


def test_hook_with_wrong_arguments_fails_at_load(site):
    bad = (
        "from chipset.discovery.hookspecs import hookimpl\n\n"
        "@hookimpl\ndef chipset_memory(device, extra):\n    return None\n"
    )
    make_plugin(site, "wrongargs", hooks=bad)
    with pytest.raises(PluginValidationError, match="extra"):
        chipset.backend("wrongargs")


def test_missing_required_hooks_are_named(site):
    partial = "from chipset.discovery.hookspecs import hookimpl\n\n@hookimpl\ndef chipset_device():\n    return None\n"
    make_plugin(site, "partial", hooks=partial)
    with pytest.raises(PluginValidationError, match="chipset_memory, chipset_collective, chipset_capabilities"):
        chipset.backend("partial")


def test_kernel_missing_error_names_backends_that_declare_it():
    b = chipset.backend("cpu_sim")
    with pytest.raises(chipset.KernelNotFoundError, match="not available on backend 'cpu_sim'"):
        b.kernels("npu_only_magic")
    # cuda declares its kernels in the descriptor, so a lookup of one names it
    assert "cuda" in b.kernels._known_elsewhere("fused_adamw")
