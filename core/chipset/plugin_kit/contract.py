"""The backend contract as data: every method a backend writes, and where the docs explain it.

One table serves two readers: the scaffold (``chipset plugin new``) generates a stub for
each entry whose error names the method and its docs section, and the conformance suite's
work plan names the same section for each method a backend leaves unimplemented.
"""

from __future__ import annotations

__all__ = ["DOCS", "METHODS", "SECTIONS", "section"]

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

METHODS: tuple[tuple[str, str, str], ...] = (
    # (interface, method a user calls, section key); the primitive a backend overrides for a
    # public Device method is ``_`` + the name (set_device -> _set_device).
    ("Device", "device_count", "device"),
    ("Device", "supported_dtypes", "device"),
    ("Device", "set_device", "device"),
    ("Device", "current_device", "device"),
    ("Device", "torch_device", "device"),
    ("Device", "synchronize", "device"),
    ("Device", "properties", "device"),
    ("Device", "manual_seed", "rng"),
    ("Device", "manual_seed_all", "rng"),
    ("Device", "get_rng_state", "rng"),
    ("Device", "set_rng_state", "rng"),
    ("Device", "stream", "streams"),
    ("Device", "current_stream", "streams"),
    ("Device", "event", "streams"),
    ("Stream", "synchronize", "streams"),
    ("Stream", "wait_event", "streams"),
    ("Stream", "wait_stream", "streams"),
    ("Stream", "query", "streams"),
    ("Stream", "record_event", "streams"),
    ("Stream", "context", "streams"),
    ("Event", "record", "streams"),
    ("Event", "wait", "streams"),
    ("Event", "synchronize", "streams"),
    ("Event", "query", "streams"),
    ("Event", "elapsed_time", "streams"),
    ("Memory", "stats", "memory"),
    ("Memory", "reset_peak_stats", "memory"),
    ("Memory", "empty_cache", "memory"),
    ("Memory", "mem_get_info", "memory"),
    ("Collective", "init_process_group", "collective"),
)


def section(interface: str, method: str) -> str:
    """``docs/writing-a-plugin.md §N Title`` for one method of the contract."""
    for iface, name, key in METHODS:
        if (iface, name) == (interface, method):
            return f"{DOCS} {SECTIONS[key]}"
    return f"{DOCS} {SECTIONS['hooks']}"
