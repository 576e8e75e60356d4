"""Discovery of real installed plugin distributions: statuses, isolation, API negotiation."""

from __future__ import annotations

import warnings

import pytest

import chipset
from chipset.discovery import ChipsetPluginWarning, discover
from chipset.errors import PluginValidationError
from plugin_factory import GOOD_SPEC, LEGACY_HOOKS, make_plugin


def _by_name():
    return {r.name: r for r in discover(refresh=True)}


def test_builtin_plugins_are_discovered_with_distribution_and_version():
    recs = _by_name()
    assert {"cpu_sim", "cuda", "ascend"} <= set(recs)
    sim = recs["cpu_sim"]
    assert sim.status == "ok"
    assert sim.distribution == "chipset-cpu-sim"
    assert sim.version
    assert sim.api_version == "1.1"
    assert sim.entry_point == "cpu_sim = chipset_cpu_sim:descriptor"


def test_hardware_plugins_report_unavailable_with_a_reason_on_this_machine():
    recs = _by_name()
    for name in ("cuda", "ascend"):
        assert recs[name].status == "unavailable"
        assert len(recs[name].reason) > 10


def test_good_third_party_plugin_is_ok_and_loads(site):
    make_plugin(site, "acme", priority=10)  # its descriptor's load() returns a BackendSpec
    rec = _by_name()["acme"]
    assert (rec.status, rec.distribution, rec.priority) == ("ok", "chipset-acme", 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the spec is not the deprecated path
        b = chipset.backend("acme")
    assert b.name == "acme" and b.spec.name == "acme"
    assert type(b.device).__module__ == "plugin_acme.backend" and b.device.backend_name == "acme"
    assert b.capabilities.kernels == ("swiglu",)  # filled from what the plugin registered
    assert b.launch_env(0, 2) == {}  # no launch_env declared


def test_legacy_hook_plugin_still_loads_with_a_deprecation_warning(site):
    launch = "\n\n@hookimpl\ndef chipset_launch_env(local_rank, local_world_size):\n    return {'OLD_RANK': str(local_rank)}\n"
    # plugin API 1.0: load() returns a module of @hookimpl functions
    make_plugin(site, "oldacme", legacy=True, impl=LEGACY_HOOKS.format(name="oldacme") + launch)
    with pytest.warns(DeprecationWarning, match=r"oldacme.*deprecated.*return a chipset.BackendSpec"):
        b = chipset.backend("oldacme")
    assert b.device.backend_name == "oldacme" and b.spec.name == "oldacme"
    assert b.capabilities.kernels == ("swiglu",) and b.capabilities.dtypes == ("float32",)
    assert b.launch_env(1, 2) == {"OLD_RANK": "1"}


_SPEC_HEAD = (
    "from chipset.discovery.spec import BackendSpec\n"
    "from chipset.interfaces import Capabilities\n"
    "from chipset_cpu_sim.collective import SimCollective\n"
    "from chipset_cpu_sim.device import SimDevice\n"
    "from chipset_cpu_sim.memory import SimMemory\n\n"
)


@pytest.mark.parametrize(
    ("name", "spec", "needles"),
    [
        ("nomem", "BackendSpec(name='nomem', device=SimDevice, memory=None, collective=SimCollective, "
                  "capabilities=Capabilities())",
         ["backend 'nomem' (nomem = plugin_nomem:descriptor)", "memory must be callable", "found NoneType",
          "§4 The hooks"]),
        ("misnamed", "BackendSpec(name='other', device=SimDevice, memory=SimMemory, collective=SimCollective, "
                     "capabilities=Capabilities())",
         ["returned the BackendSpec of 'other'", "must equal the descriptor's ('misnamed')"]),
        ("badcaps", "BackendSpec(name='badcaps', device=SimDevice, memory=SimMemory, collective=SimCollective, "
                    "capabilities={'dtypes': ('float32',)})",
         ["BackendSpec.capabilities must give a chipset.interfaces.capabilities.Capabilities", "found dict"]),
        ("baddev", "BackendSpec(name='baddev', device=object, memory=SimMemory, collective=SimCollective, "
                   "capabilities=Capabilities())",
         ["BackendSpec.device must give a chipset.interfaces.device.Device", "found object"]),
    ],
)
def test_a_bad_spec_is_refused_at_load_saying_which_field(site, name, spec, needles):
    make_plugin(site, name, impl=_SPEC_HEAD + f"spec = {spec}\n")
    assert _by_name()[name].status == "ok"  # describing and probing never touch the spec
    with pytest.raises(PluginValidationError) as err:
        chipset.backend(name)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_launch_env_that_is_not_str_to_str_is_refused_naming_it(site):
    impl = GOOD_SPEC.format(name="numenv") + (
        "\nimport dataclasses\nspec = dataclasses.replace(spec, launch_env=lambda rank, world: {'N': rank})\n")
    make_plugin(site, "numenv", impl=impl)
    with pytest.raises(PluginValidationError, match=r"backend 'numenv': launch_env must return a dict of str to str.*'N': 0"):
        chipset.backend("numenv").launch_env(0, 1)


def test_load_returning_neither_a_spec_nor_hooks_says_what_to_do(site):
    # chipset_device without @hookimpl: pluggy would silently ignore it
    make_plugin(site, "bare", legacy=True, impl="def chipset_device():\n    return None\n")
    with pytest.raises(PluginValidationError) as err:
        chipset.backend("bare")
    msg = str(err.value)
    assert "backend 'bare' (bare = plugin_bare:descriptor)" in msg
    assert "load() must return a chipset.BackendSpec, found module 'plugin_bare.backend'" in msg  # expected, found
    assert "not marked @chipset.hookimpl: chipset_device" in msg
    assert "Return BackendSpec(name=..., device=..., memory=..., collective=..., capabilities=...)" in msg  # what to do


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the legacy hook path
def test_hooks_outside_the_spec_fail_at_load_quoting_the_hook(site):
    bad = "from chipset.discovery.hookspecs import hookimpl\n\n@hookimpl\ndef chipset_devise():\n    return None\n"
    make_plugin(site, "typo", legacy=True, impl=bad)
    with pytest.raises(PluginValidationError, match="chipset_devise"):
        chipset.backend("typo")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hook_with_wrong_arguments_fails_at_load(site):
    bad = (
        "from chipset.discovery.hookspecs import hookimpl\n\n"
        "@hookimpl\ndef chipset_memory(device, extra):\n    return None\n"
    )
    make_plugin(site, "wrongargs", legacy=True, impl=bad)
    with pytest.raises(PluginValidationError, match="extra"):
        chipset.backend("wrongargs")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_missing_required_hooks_are_named(site):
    partial = "from chipset.discovery.hookspecs import hookimpl\n\n@hookimpl\ndef chipset_device():\n    return None\n"
    make_plugin(site, "partial", legacy=True, impl=partial)
    with pytest.raises(PluginValidationError, match="chipset_memory, chipset_collective, chipset_capabilities"):
        chipset.backend("partial")


def test_kernel_missing_error_names_backends_that_declare_it():
    b = chipset.backend("cpu_sim")
    with pytest.raises(chipset.KernelNotFoundError, match="not available on backend 'cpu_sim'"):
        b.kernels("npu_only_magic")
    # cuda declares its kernels in the descriptor, so a lookup of one names it
    assert "cuda" in b.kernels._known_elsewhere("fused_adamw")
