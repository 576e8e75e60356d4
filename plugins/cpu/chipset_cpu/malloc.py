"""glibc's malloc on a training rank: keep freed memory for the next step instead of returning it.

A training step frees most of what it allocated (activations, gradient temporaries) and
allocates the same sizes again in the next step. With glibc's defaults, a buffer above the
mmap threshold (128 KiB, raised on the fly up to 32 MiB) gets its own mapping and a free
returns it to the kernel, and a free top of the heap larger than the trim threshold is
returned too; the next step then takes every such page back through a minor page fault,
zeroed by the kernel. On the pipeline benchmark that was 300-2,400 faults a step on a rank
(docs/benchmarks.md, issue 38). This module raises both thresholds once, when the backend
selects a device for a rank, so the process keeps what it has freed and reuses it. The peak
resident memory is what the step needs either way; what changes is that the memory stays
resident between the peaks.

Applied only on glibc (``mallopt`` through ctypes), never where the user tuned malloc
already (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or
``GLIBC_TUNABLES`` set: their setting wins), and not with ``CHIPSET_CPU_MALLOC=system``.
"""

from __future__ import annotations

import ctypes
import logging
import os

from chipset.errors import ConfigError

log = logging.getLogger("chipset.cpu.malloc")  # under chipset's logger: a rank prints it with its rank

MALLOC_ENV = "CHIPSET_CPU_MALLOC"
"""``keep`` (default): raise glibc's thresholds as below; ``system``: leave malloc as it is."""

MMAP_THRESHOLD = 64 << 20
"""Buffers up to 64 MiB come from the heap (reused) instead of a mapping of their own."""

TRIM_THRESHOLD = 1 << 30
"""A free top of the heap up to 1 GiB stays with the process instead of going back to the kernel."""

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
_M_MMAP_THRESHOLD = -3

_applied: str | None = None


def mode() -> str:
    """``CHIPSET_CPU_MALLOC``: ``keep`` (the default) or ``system``."""
    raw = os.environ.get(MALLOC_ENV, "").strip().lower() or "keep"
    if raw not in ("keep", "system"):
        raise ConfigError(f"{MALLOC_ENV} must be 'keep' (reuse freed memory across steps, the default) or "
                          f"'system' (glibc's own malloc settings), found {os.environ[MALLOC_ENV]!r}")
    return raw


def _glibc():
    """The process's glibc as a ctypes library, or None (another C library, or none found)."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc if version() else None


def reason_to_leave() -> str | None:
    """Why malloc stays as it is here (the switch, the user's own settings, not glibc), or None."""
    if mode() == "system":
        return f"{MALLOC_ENV}=system"
    if user := [k for k in USER_SETTINGS if k in os.environ]:
        return f"the environment sets {', '.join(user)}"
    if _glibc() is None:
        return "not glibc"
    return None


def keep_freed_memory() -> str:
    """Raise the thresholds once per process; returns ``"tuned"`` or why malloc was left alone."""
    global _applied
    if _applied is not None:
        return _applied
    reason = reason_to_leave()
    if reason is None:
        libc = _glibc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        reason = None if ok else "mallopt refused the thresholds"
    _applied = "tuned" if reason is None else f"left as it is ({reason})"
    if reason is None:
        log.info("cpu backend: glibc malloc keeps freed memory for reuse (mmap threshold %d MiB, trim threshold "
                 "%d MiB); %s=system leaves glibc's defaults", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, MALLOC_ENV)
    else:
        log.info("cpu backend: glibc malloc %s", _applied)
    return _applied
