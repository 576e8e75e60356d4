"""Device: count, selection, out-of-range errors, properties consistent with the declared profile."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from chipset.discovery.profiles import all_profiles
from chipset.errors import DeviceIndexError

if TYPE_CHECKING:
    from chipset.loader import Backend


def _indices(backend: Backend, limit=4):
    return list(range(min(backend.device.device_count(), limit)))


def test_device_count_is_positive(backend: Backend):
    assert backend.device.device_count() >= 1


def test_set_device_makes_each_device_current(backend: Backend):
    d = backend.device
    try:
        for i in _indices(backend):
            d.set_device(i)
            assert d.current_device() == i
    finally:
        d.set_device(0)


@pytest.mark.parametrize("bad", ["count", -1, "count+5"])
def test_out_of_range_index_raises_device_index_error(backend: Backend, bad):
    n = backend.device.device_count()
    index = {"count": n, "count+5": n + 5}.get(bad, bad)
    with pytest.raises(DeviceIndexError, match="out of range"):
        backend.device.set_device(index)
    with pytest.raises(DeviceIndexError):
        backend.device.properties(index)
    assert backend.device.current_device() == 0


def test_torch_device_has_the_declared_type(backend: Backend):
    t = backend.device.torch_device(0)
    assert isinstance(t, torch.device) and t.type == backend.device.device_type
    x = torch.ones(4, device=t)
    assert x.device.type == backend.device.device_type


def test_synchronize_returns(backend: Backend):
    backend.device.synchronize()
    backend.device.synchronize(0)


def test_properties_are_sane(backend: Backend):
    for i in _indices(backend):
        p = backend.device.properties(i)
        assert p.name and p.index == i
        assert p.total_memory > 0
        assert all(v >= 0 for v in p.peak_flops.values())
        assert p.memory_bandwidth >= 0 and p.intra_node_bandwidth >= 0 and p.inter_node_bandwidth >= 0
        assert p.intra_node_latency >= 0 and p.inter_node_latency >= 0


def test_properties_agree_with_memory_interface(backend: Backend):
    p = backend.device.properties(0)
    free, total = backend.memory.mem_get_info(0)
    assert total == p.total_memory, f"mem_get_info total {total} != properties.total_memory {p.total_memory}"
    assert 0 <= free <= total


# A device reports at most its datasheet capacity: drivers keep some for themselves (under
# 1% on A100/H100/H200, about 5% on Ascend 910B), and a partition or a capped test double
# reports less. More than the profile declares means the profile understates the device,
# e.g. capacity written in GB (1e9) where the device counts GiB: 7.4% more. 1% of slack.
MEMORY_SLACK = 0.01


def test_properties_match_a_declared_profile_of_the_same_name(backend: Backend, backend_name):
    """The device's properties agree with the profile the backend declares for it: the profile
    named like the device, or whose own ``name`` is the device's (a profile key such as
    ``h200`` for a device reporting "NVIDIA H200")."""
    p = backend.device.properties(0)
    declared = {n: props for n, (owner, props) in all_profiles().items() if owner == backend_name}
    by_name = {n: props for n, props in declared.items() if props.name == p.name}
    if p.name in declared:
        key, ref = p.name, declared[p.name]
    elif len(by_name) == 1:
        (key, ref), = by_name.items()
    else:
        pytest.skip(f"backend does not declare a profile for a device named {p.name!r} (BackendDescriptor.profiles)")
    assert dict(p.peak_flops) == dict(ref.peak_flops), f"peak FLOP/s differ from profile {key!r}"
    assert p.memory_bandwidth == ref.memory_bandwidth, f"memory bandwidth differs from profile {key!r}"
    assert p.total_memory <= (1 + MEMORY_SLACK) * ref.total_memory, (
        f"device reports {p.total_memory} bytes, more than the {ref.total_memory} profile {key!r} declares "
        "(capacity in GB where GiB was meant?)")


def test_visible_devices_variable_limits_the_device_count(backend: Backend, backend_name):
    """The backend's ``visible_devices_env`` must restrict what a fresh process sees (launchers
    and the engine set it per rank)."""
    import os
    import subprocess
    import sys

    var = backend.device.visible_devices_env
    assert var, "Device.visible_devices_env is empty: declare the variable that restricts visible devices"
    n = backend.device.device_count()
    if n < 2:
        pytest.skip(f"needs 2 visible devices to show a restriction, found {n}")
    env = dict(os.environ, **{var: "1"}, CHIPSET_BACKEND=backend_name)
    code = "import chipset; print(chipset.backend().device.device_count())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = int(proc.stdout.strip().splitlines()[-1])
    assert seen == 1, f"with {var}=1 a new process sees {seen} device(s), expected 1 (without it: {n})"
