"""Discovery: the backend is installed like any vendor package, its descriptor is cheap and safe."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from chipset._version import API_VERSION, api_compatible
from chipset.discovery.descriptor import BackendDescriptor
from chipset.discovery.records import discover
from chipset.interfaces import ALL_COLLECTIVES, Collective, Device, Memory
from chipset.interfaces.device import dtype_name

if TYPE_CHECKING:
    from chipset.loader import Backend


@pytest.fixture(scope="module")
def record(backend_name):
    recs = [r for r in discover(refresh=True) if r.name == backend_name]
    assert recs, f"backend {backend_name!r} is not among the installed backends"
    return recs[0]


@pytest.fixture(scope="module")
def isolated(backend_name):
    """Import the descriptor and run probe() in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "chipset.conformance._isolation", backend_name],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"descriptor import/probe subprocess failed:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_backend_is_installed_and_available(record):
    assert record.status == "ok", f"status {record.status}: {record.reason}"


def test_backend_comes_from_an_installed_distribution(record):
    assert record.distribution, "the entry point must belong to an installed distribution (pip install it)"
    assert record.version


def test_api_version_is_declared_and_compatible(record):
    assert record.api_version is not None, "descriptor must declare api_version=(major, minor)"
    major, minor = (int(x) for x in record.api_version.split("."))
    ok, why = api_compatible((major, minor), API_VERSION)
    assert ok, why


def test_descriptor_fields_are_well_formed(record, backend_name):
    d = record.descriptor
    assert isinstance(d, BackendDescriptor)
    assert d.name == backend_name
    assert isinstance(d.priority, int)
    assert callable(d.probe) and callable(d.load)


def test_descriptor_import_pulls_in_no_vendor_sdk(isolated):
    assert "error" not in isolated, isolated.get("error")
    assert isolated["foreign_modules"] == [], (
        f"importing the descriptor imported {isolated['foreign_modules']}; a descriptor must import "
        "no vendor SDK (defer those imports to load())"
    )


def test_probe_returns_ok_and_reason(isolated):
    assert "probe_error" not in isolated, f"probe() raised {isolated.get('probe_error')}"
    ok, reason = isolated["probe"]
    assert ok is True and reason, f"probe() returned ({ok}, {reason!r}) in a fresh process"


def test_probe_does_not_initialise_the_device(isolated):
    assert isolated["device_initialized"] is not True, (
        "the descriptor reports its device initialised right after probe(): probe() must never "
        "initialise a device (it has to stay fork-safe)"
    )
    assert isolated["accelerator_allocator_initialized"] is not True, (
        "torch's accelerator allocator is initialised after probe(): probe() must not touch the device"
    )


def test_spec_builds_the_interfaces(backend: Backend):
    assert isinstance(backend.device, Device)
    assert isinstance(backend.memory, Memory)
    assert isinstance(backend.collective, Collective)


def test_capabilities_name_known_collectives_and_real_dtypes(caps, backend: Backend):
    unknown = [c for c in caps.collectives if c not in ALL_COLLECTIVES]
    assert not unknown, f"capabilities name unknown collectives {unknown}; valid: {ALL_COLLECTIVES}"
    declared = {dtype_name(d) for d in backend.device.supported_dtypes}
    assert set(caps.dtypes) == declared, (
        f"Capabilities.dtypes {sorted(caps.dtypes)} and Device.supported_dtypes {sorted(declared)} disagree"
    )
    assert set(caps.collective_dtypes) <= declared
    assert set(caps.amp_dtypes) <= declared


def test_registered_kernels_match_capabilities(caps, backend: Backend):
    own = sorted(n for n in backend.kernels.names() if backend.kernels.implementations(n))
    assert sorted(caps.kernels) == own
