"""cpu_sim devices: count and visibility from the environment, properties from named profiles."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

import forked_cli
import testenv
from chipset.errors import ConfigError, DeviceIndexError
from chipset_cpu_sim.device import SimDevice
from chipset_cpu_sim.profiles import PROFILES


def _cli(*args, env=None, pythonpath=None):
    e = testenv.clean_env()
    e.update(env or {})
    if pythonpath:
        e["PYTHONPATH"] = os.pathsep.join([str(pythonpath), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True, env=e, timeout=120)


@pytest.fixture(autouse=True)
def _sim_env(monkeypatch):
    for var in ("CHIPSET_SIM_DEVICES", "CHIPSET_SIM_VISIBLE_DEVICES", "CHIPSET_SIM_PROFILE", "CHIPSET_SIM_FAULTS"):
        monkeypatch.delenv(var, raising=False)


def test_chipset_info_shows_three_devices_when_asked_for_three():
    proc = _cli("info", "--json", env={"CHIPSET_SIM_DEVICES": "3", "CHIPSET_BACKEND": "cpu_sim"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["backend"] == "cpu_sim"
    assert info["device_count"] == 3
    assert [d["index"] for d in info["devices"]] == [0, 1, 2]


def test_a_named_profile_shows_its_capacity():
    proc = _cli("info", "--json", env={"CHIPSET_SIM_PROFILE": "sim-small", "CHIPSET_SIM_DEVICES": "2", "CHIPSET_BACKEND": "cpu_sim"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert {d["total_memory"] for d in info["devices"]} == {256 * 2**20}
    assert info["devices"][0]["name"] == "sim-small"
    assert info["devices"][0]["memory"]["total"] == 256 * 2**20


def test_default_is_eight_generic_devices():
    d = SimDevice()
    assert d.device_count() == 8
    assert d.properties(0).name == "sim-generic"
    assert d.properties(0).total_memory == PROFILES["sim-generic"].memory


def test_visible_devices_restrict_and_renumber(monkeypatch):
    monkeypatch.setenv("CHIPSET_SIM_DEVICES", "4")
    monkeypatch.setenv("CHIPSET_SIM_VISIBLE_DEVICES", "3,1")
    d = SimDevice()
    assert d.device_count() == 2
    assert "physical device 3" in d.properties(0).source
    assert "physical device 1" in d.properties(1).source
    with pytest.raises(DeviceIndexError, match="CHIPSET_SIM_VISIBLE_DEVICES"):
        d.set_device(2)


def test_visible_device_out_of_range_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CHIPSET_SIM_DEVICES", "2")
    monkeypatch.setenv("CHIPSET_SIM_VISIBLE_DEVICES", "0,5")
    with pytest.raises(ConfigError, match=r"\[5\]"):
        SimDevice()


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_device_count_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("CHIPSET_SIM_DEVICES", value)
    with pytest.raises(ConfigError, match="CHIPSET_SIM_DEVICES must be a positive integer"):
        SimDevice()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_sim_profile_is_selectable(monkeypatch, name):
    monkeypatch.setenv("CHIPSET_SIM_PROFILE", name)
    p = SimDevice().properties(0)
    assert p.name == name and p.total_memory == PROFILES[name].memory and p.estimated
    assert p.peak_flops_for("bfloat16") > 0


def test_unknown_profile_is_a_config_error_listing_the_known_ones(monkeypatch):
    monkeypatch.setenv("CHIPSET_SIM_PROFILE", "warp-drive")
    with pytest.raises(ConfigError) as info:
        SimDevice()
    assert "warp-drive" in str(info.value) and "sim-generic" in str(info.value) and "sim-small" in str(info.value)


def test_profile_declared_by_another_installed_backend_is_simulated(tmp_path):
    """A vendor package declares 'acme-x1' via BackendDescriptor.profiles; the simulator can become one."""
    site = tmp_path / "site"
    (site / "acme_profiles").mkdir(parents=True)
    (site / "acme_profiles" / "__init__.py").write_text(textwrap.dedent("""
        from chipset.discovery.descriptor import BackendDescriptor

        def _profiles():
            from chipset.interfaces.device import DeviceProperties
            return {"acme-x1": DeviceProperties(name="ACME X1", index=0, total_memory=48 * 2**30,
                                                peak_flops={"bfloat16": 500e12}, memory_bandwidth=2e12)}

        descriptor = BackendDescriptor(name="acme", api_version=(1, 0), priority=5,
                                       probe=lambda: (False, "no ACME card here"), load=lambda: None,
                                       profiles=_profiles)
    """))
    info = site / "chipset_acme-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: chipset-acme\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[chipset.backends]\nacme = acme_profiles:descriptor\n")
    proc = _cli("info", "--json", env={"CHIPSET_SIM_PROFILE": "acme-x1", "CHIPSET_SIM_DEVICES": "1", "CHIPSET_BACKEND": "cpu_sim"},
                pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    dev = json.loads(proc.stdout)["devices"][0]
    assert dev["name"] == "acme-x1"
    assert dev["total_memory"] == 48 * 2**30
    assert dev["peak_flops"] == {"bfloat16": 500e12}
    assert "declared by backend 'acme'" in dev["source"]


def test_unknown_profile_via_cli_exits_2_with_the_fix():
    proc = _cli("info", env={"CHIPSET_SIM_PROFILE": "nope", "CHIPSET_BACKEND": "cpu_sim"})
    assert proc.returncode == 2
    assert "CHIPSET_SIM_PROFILE='nope'" in proc.stderr and "sim-generic" in proc.stderr
