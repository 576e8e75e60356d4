"""cpu backend: glibc malloc keeps freed memory on a rank (chipset_cpu.malloc), switchable off."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import testenv
from chipset.errors import ConfigError
from chipset_cpu import malloc

# A rank of the cpu backend selects its device, then frees and re-allocates a 40 MiB buffer (above
# glibc's largest automatic mmap threshold, 32 MiB) four times: the least resident memory given back
# when it is freed, and the fewest minor page faults of touching a new one (the CI's run once saw the
# new buffer placed in fresh pages after one free: small allocations in between can split the freed
# chunk, which steady steps then reuse).
_RANK = textwrap.dedent("""
    import json, os, resource, torch
    from chipset_cpu import malloc
    from chipset_cpu.device import CpuDevice
    CpuDevice().set_device(0)
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    faults, given_back = [], []
    for _ in range(4):  # as training steps do; the first free may be split by small allocations
        t = torch.empty(10 << 20, dtype=torch.float32)
        t.fill_(1.0)
        held = rss()
        del t
        freed = rss()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(10 << 20, dtype=torch.float32)
        t.fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        given_back.append(held - freed)
        del t
    print(json.dumps({"faults": min(faults), "given_back": min(given_back), "applied": malloc.keep_freed_memory()}))
""")

BUFFER = 40 << 20


def _rank(**env) -> dict:
    e = testenv.clean_env()
    e.update(env)
    proc = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, env=e, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(autouse=True)
def _no_malloc_env(monkeypatch):
    for var in (malloc.MALLOC_ENV, *malloc.USER_SETTINGS):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.skipif(malloc._glibc() is None, reason="mallopt is glibc's; this C library has none")
def test_a_rank_reuses_a_freed_buffer_and_system_gives_it_back():
    kept = _rank()
    system = _rank(CHIPSET_CPU_MALLOC="system")
    assert kept["applied"] == "tuned"
    assert system["applied"] == "left as it is (CHIPSET_CPU_MALLOC=system)"
    # Kept: the freed buffer stays resident and the next one reuses it without a page fault.
    # System: the free gives it back to the kernel, and touching the next one faults its pages in
    # (4 KiB pages, or fewer faults where transparent huge pages back the mapping).
    assert kept["given_back"] < BUFFER // 8, kept
    assert kept["faults"] < BUFFER // 4096 // 20, kept
    assert system["given_back"] >= BUFFER - (1 << 20), system
    assert system["faults"] > kept["faults"], system


def test_the_users_own_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert malloc.reason_to_leave() == "the environment sets MALLOC_TRIM_THRESHOLD_"


def test_an_unknown_setting_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(malloc.MALLOC_ENV, "off")
    with pytest.raises(ConfigError, match=r"CHIPSET_CPU_MALLOC must be 'keep' .* or 'system' .* found 'off'"):
        malloc.reason_to_leave()
