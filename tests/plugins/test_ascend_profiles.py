"""Ascend 910B profiles: pure data any machine can read, with sources and estimate labels."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chipset.discovery.profiles import all_profiles, get_profile
from chipset_ascend.properties import PROFILES, normalise_soc_name, profile_for_soc_name

GiB = 2**30


def test_profiles_are_served_by_the_ascend_descriptor():
    names = {n for n, (backend, _) in all_profiles().items() if backend == "ascend"}
    assert {"910b", "910b1", "910b2", "910b3", "910b4"} <= names


def test_reading_profiles_imports_no_torch_npu_and_needs_no_npu():
    code = (
        "import sys; from chipset.discovery.profiles import get_profile; p = get_profile('910b2'); "
        "assert p.total_memory == 64 * 2**30 and p.peak_flops['bfloat16'] > 0, p; "
        "assert 'torch_npu' not in sys.modules and 'chipset_ascend.backend' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_is_complete_and_labelled(name):
    p = get_profile(name)
    assert p.total_memory in (32 * GiB, 64 * GiB)
    assert p.peak_flops["float16"] == p.peak_flops["bfloat16"] >= 250e12
    assert p.memory_bandwidth > 0 and p.intra_node_bandwidth > p.inter_node_bandwidth > 0
    assert p.estimated and "docs/ascend.md" in p.source


def test_variants_are_ordered_as_reported():
    flops = [PROFILES[n].peak_flops["bfloat16"] for n in ("910b1", "910b2", "910b3", "910b4")]
    assert flops == sorted(flops, reverse=True)
    assert PROFILES["910b4"].total_memory < PROFILES["910b3"].total_memory


@pytest.mark.parametrize(
    "soc, profile",
    [("Ascend910B3", "910b3"), ("Ascend910B2C", "910b2"), ("ascend 910B1", "910b1"), ("Ascend910B", "910b"), ("Ascend910A", None), ("Ascend310P3", None)],
)
def test_soc_names_map_to_profiles(soc, profile):
    got = profile_for_soc_name(soc)
    assert (got is None) if profile is None else (got is PROFILES[profile]), normalise_soc_name(soc)
