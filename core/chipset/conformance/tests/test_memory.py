"""Memory: statistics, exact accounting, peaks, OOM type and message, recovery, empty_cache.

Accounting is exact up to allocator rounding: a tensor of N bytes adds between N and N
rounded up to GRANULARITY bytes (512, the caching-allocator block every backend here uses).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import pytest
import torch

import chipset
from chipset.interfaces import MemoryStats

if TYPE_CHECKING:
    from chipset.loader import Backend

GRANULARITY = 512


def _round(n: int) -> int:
    return (n + GRANULARITY - 1) // GRANULARITY * GRANULARITY


@pytest.fixture
def exact(backend: Backend):
    if backend.capabilities.memory_accounting != "exact":
        pytest.skip(f"backend declares memory_accounting={backend.capabilities.memory_accounting!r}, not exact")


def _allocated(backend: Backend) -> int:
    backend.device.synchronize()
    return backend.memory.stats(0).allocated


def test_stats_have_every_key_as_non_negative_ints(backend: Backend):
    s = backend.memory.stats(0)
    assert isinstance(s, MemoryStats)
    for key, value in s.to_dict().items():
        assert isinstance(value, int) and value >= 0, f"{key}={value!r}"
    assert s.reserved >= s.allocated
    assert s.peak_allocated >= s.allocated and s.peak_reserved >= s.reserved


@pytest.mark.parametrize("numel", [1, 256, 1000, 4097, 65536])
def test_allocation_is_accounted_exactly(backend: Backend, dev, numel, exact):
    gc.collect()
    before = _allocated(backend)
    x = torch.empty(numel, dtype=torch.float32, device=dev)
    grown = _allocated(backend) - before
    nbytes = numel * 4
    assert nbytes <= grown <= _round(nbytes), (
        f"a float32 tensor of {numel} elements ({nbytes} bytes) changed allocated by {grown} bytes; "
        f"expected {nbytes}..{_round(nbytes)}"
    )
    del x
    gc.collect()
    assert _allocated(backend) == before, "freeing the tensor did not return allocated to its previous value"


def test_float32_256_elements_adds_1024_bytes(backend: Backend, dev, exact):
    before = _allocated(backend)
    x = torch.zeros(256, dtype=torch.float32, device=dev)
    assert _allocated(backend) - before == 1024
    del x


def test_a_leak_is_visible_in_the_stats(backend: Backend, dev, exact):
    before = _allocated(backend)
    kept = [torch.ones(1024, device=dev) for _ in range(4)]
    assert _allocated(backend) - before >= 4 * 4096
    kept.clear()
    gc.collect()
    assert _allocated(backend) == before


def test_views_are_not_double_counted(backend: Backend, dev, exact):
    x = torch.ones(4096, device=dev)
    before = _allocated(backend)
    views = [x[:100], x.view(64, 64), x[1::2]]
    assert _allocated(backend) == before
    del views, x


def test_peak_tracks_the_maximum_and_resets(backend: Backend, dev, exact):
    m = backend.memory
    m.reset_peak_stats(0)
    base = _allocated(backend)
    x = torch.empty(1 << 18, dtype=torch.float32, device=dev)  # 1 MiB
    del x
    gc.collect()
    s = m.stats(0)
    assert s.peak_allocated >= base + (1 << 20), f"peak {s.peak_allocated} missed a 1 MiB allocation over {base}"
    m.reset_peak_stats(0)
    s = m.stats(0)
    assert s.peak_allocated == s.allocated and s.peak_reserved == s.reserved, (
        f"after reset_peak_stats: peak_allocated {s.peak_allocated} (allocated {s.allocated}), "
        f"peak_reserved {s.peak_reserved} (reserved {s.reserved}); expected the peaks reset to the current values"
    )


def test_empty_cache_releases_cached_blocks(backend: Backend, dev):
    m = backend.memory
    x = torch.empty(1 << 18, dtype=torch.float32, device=dev)
    del x
    gc.collect()
    cached = m.stats(0)
    m.empty_cache()
    after = m.stats(0)
    assert after.reserved <= cached.reserved
    assert after.reserved >= after.allocated
    if cached.reserved - cached.allocated >= 1 << 20:
        # The backend kept the freed 1 MiB cached (it reports it reserved): empty_cache must
        # hand it back, not merely not grow.
        assert after.reserved <= cached.reserved - (1 << 20), (
            f"empty_cache left reserved at {after.reserved} bytes (was {cached.reserved}, allocated "
            f"{cached.allocated}): the cached 1 MiB block was not released"
        )


def test_mem_get_info_is_consistent(backend: Backend):
    free, total = backend.memory.mem_get_info(0)
    assert 0 <= free <= total
    assert total == backend.memory.total_memory(0) == backend.device.properties(0).total_memory


@pytest.fixture
def enforced(caps):
    if not caps.memory_capacity_enforced:
        pytest.skip("backend does not declare capability memory_capacity_enforced")


def _oom(backend: Backend, dev):
    total = backend.memory.total_memory(0)
    with backend.memory.oom_guard(str(dev)):
        return torch.empty(total + (64 << 20), dtype=torch.uint8, device=dev)


def test_allocating_past_capacity_raises_chipset_oom(backend: Backend, dev, enforced):
    with pytest.raises(chipset.OutOfMemoryError) as info:
        _oom(backend, dev)
    assert "Tried to allocate" in str(info.value)


def test_oom_error_is_a_runtime_error_with_requested_bytes(backend: Backend, dev, enforced):
    with pytest.raises(RuntimeError) as info:
        _oom(backend, dev)
    assert isinstance(info.value, chipset.OutOfMemoryError)
    total = backend.memory.total_memory(0)
    assert info.value.requested_bytes is None or info.value.requested_bytes > total // 2


def test_device_is_usable_after_oom(backend: Backend, dev, enforced):
    before = _allocated(backend)
    with pytest.raises(chipset.OutOfMemoryError):
        _oom(backend, dev)
    assert _allocated(backend) == before, "a failed allocation left bytes accounted"
    x = torch.ones(1 << 18, device=dev)
    assert float(x.sum()) == float(1 << 18)
    del x
