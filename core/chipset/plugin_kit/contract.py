"""The backend contract as data: every method a backend writes, and where the docs explain it.

One table serves two readers: the scaffold (``chipset plugin new``) generates a stub for
each required entry whose error names the method and its docs section, and the conformance
suite's work plan names the same section for each method a backend leaves unimplemented.
An optional entry has a working default (streams and events: chipset.interfaces.streams);
the scaffold writes no stub for it, and a backend overrides it only to do better.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DOCS", "METHODS", "SECTIONS", "Method", "section"]

DOCS = "docs/writing-a-plugin.md"

SECTIONS: dict[str, str] = {
    "device": "§5 Device",
    "rng": "§9 RNG: devices sharing one generator",
    "streams": "§9 Streams and event timing",
    "memory": "§6 Memory, §9 Host-memory backends",
    "collective": "§7 Collective",
    "hooks": "§4 The hooks",
}
"""Section of :data:`DOCS` per part of the contract."""


class Method(NamedTuple):
    """One method of the contract."""

    interface: str
    method: str
    """The method a user calls; the primitive a backend overrides for a public Device method
    is ``_`` + the name (set_device -> _set_device)."""
    section: str
    """Key of :data:`SECTIONS`."""
    required: bool
    """False: the interface has a working default a backend need not override."""


METHODS: tuple[Method, ...] = tuple(Method(*row) for row in (
    # (interface, method, section key, required)
    ("Device", "device_count", "device", True),
    ("Device", "supported_dtypes", "device", True),
    ("Device", "set_device", "device", True),
    ("Device", "current_device", "device", True),
    ("Device", "torch_device", "device", True),
    ("Device", "synchronize", "device", True),
    ("Device", "properties", "device", True),
    ("Device", "manual_seed", "rng", True),
    ("Device", "manual_seed_all", "rng", True),
    ("Device", "get_rng_state", "rng", True),
    ("Device", "set_rng_state", "rng", True),
    ("Device", "stream", "streams", False),
    ("Device", "current_stream", "streams", False),
    ("Device", "event", "streams", False),
    ("Stream", "synchronize", "streams", False),
    ("Stream", "wait_event", "streams", False),
    ("Stream", "wait_stream", "streams", False),
    ("Stream", "query", "streams", False),
    ("Stream", "record_event", "streams", False),
    ("Stream", "context", "streams", False),
    ("Event", "record", "streams", False),
    ("Event", "wait", "streams", False),
    ("Event", "synchronize", "streams", False),
    ("Event", "query", "streams", False),
    ("Event", "elapsed_time", "streams", False),
    ("Memory", "stats", "memory", True),
    ("Memory", "reset_peak_stats", "memory", True),
    ("Memory", "empty_cache", "memory", True),
    ("Memory", "mem_get_info", "memory", True),
    ("Collective", "init_process_group", "collective", True),
))


def section(interface: str, method: str) -> str:
    """``docs/writing-a-plugin.md §N Title`` for one method of the contract."""
    for m in METHODS:
        if (m.interface, m.method) == (interface, method):
            return f"{DOCS} {SECTIONS[m.section]}"
    return f"{DOCS} {SECTIONS['hooks']}"
