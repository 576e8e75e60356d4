"""The work plan: which methods of a backend still raise NotImplementedError.

Probed once, before any check runs, so an unfinished backend (a fresh scaffold) gets one
list - interface, method, docs section, each once - instead of every check failing on the
same missing method. Only NotImplementedError counts: any other error is left for the
checks to report. Stream and Event methods have defaults, so only a backend's own override
can be unfinished; contexts and waits are probed only when the backend declares
``streams``, as only then are they required.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chipset.interfaces import Collective
from chipset.plugin_kit.contract import METHODS, section

if TYPE_CHECKING:
    from chipset.loader import Backend

log = logging.getLogger(__name__)

_NAMED = re.compile(r"\b(Device|Stream|Event|Memory|Collective)\.(\w+)\b")
_KNOWN = {(m.interface, m.method) for m in METHODS}


def _attribute(exc: NotImplementedError, probed: tuple[str, str]) -> tuple[str, str]:
    """The method the error is about: the one its message names (a stub that another,
    implemented method called), else the one probed."""
    for m in _NAMED.finditer(str(exc)):
        if (m[1], m[2]) in _KNOWN:
            return m[1], m[2]
    return probed


def unimplemented(backend: Backend) -> list[dict[str, str]]:
    """``[{interface, method, docs, error}]`` for each method of ``backend`` raising NotImplementedError."""
    found: dict[tuple[str, str], dict[str, str]] = {}

    def probe(interface: str, method: str, call: Callable[[], object]):
        try:
            return call()
        except NotImplementedError as exc:
            key = _attribute(exc, (interface, method))
            found.setdefault(key, {"interface": key[0], "method": key[1], "docs": section(*key),
                                   "error": str(exc).strip().splitlines()[0] if str(exc).strip() else ""})
        except Exception as exc:  # the checks report it, with their own context
            log.debug("work-plan probe %s.%s raised %r", interface, method, exc)
        return None

    dev, mem, coll, caps = backend.device, backend.memory, backend.collective, backend.capabilities
    host_rng = torch.get_rng_state()
    probe("Device", "device_count", dev.device_count)
    probe("Device", "supported_dtypes", lambda: dev.supported_dtypes)
    probe("Device", "set_device", lambda: dev._set_device(0))
    probe("Device", "current_device", dev._current_device)
    probe("Device", "torch_device", lambda: dev._torch_device(0))
    probe("Device", "synchronize", lambda: dev._synchronize(0))
    probe("Device", "properties", lambda: dev._properties(0))
    state = probe("Device", "get_rng_state", lambda: dev.get_rng_state(0))
    probe("Device", "manual_seed", lambda: dev.manual_seed(0))
    probe("Device", "manual_seed_all", lambda: dev.manual_seed_all(0))
    probe("Device", "set_rng_state", lambda: dev.set_rng_state(host_rng if state is None else state, 0))
    torch.set_rng_state(host_rng)
    # Streams and events have defaults (interfaces/streams.py): only a backend's own override
    # can raise NotImplementedError. Contexts and waits are required where ``streams`` is declared.
    stream = probe("Device", "stream", dev.stream)
    current = probe("Device", "current_stream", dev.current_stream)
    start = probe("Device", "event", lambda: dev.event(enable_timing=caps.event_timing))
    end = probe("Device", "event", lambda: dev.event(enable_timing=caps.event_timing))
    if stream is not None:
        probe("Stream", "synchronize", stream.synchronize)
        probe("Stream", "query", stream.query)
        recorded = probe("Stream", "record_event", stream.record_event)
        if caps.streams:
            if current is not None:
                probe("Stream", "wait_stream", lambda: stream.wait_stream(current))
            if recorded is not None:
                probe("Stream", "wait_event", lambda: stream.wait_event(recorded))

            def enter_context():
                with stream.context():
                    pass

            probe("Stream", "context", enter_context)
    if start is not None and end is not None:
        probe("Event", "record", start.record)
        probe("Event", "record", end.record)
        if caps.streams:
            probe("Event", "wait", start.wait)
        probe("Event", "synchronize", end.synchronize)
        probe("Event", "query", end.query)
        probe("Event", "elapsed_time", lambda: start.elapsed_time(end))  # RuntimeError without timing: fine
    probe("Memory", "stats", lambda: mem.stats(0))
    probe("Memory", "reset_peak_stats", lambda: mem.reset_peak_stats(0))
    probe("Memory", "empty_cache", mem.empty_cache)
    probe("Memory", "mem_get_info", lambda: mem.mem_get_info(0))
    init = type(coll).init_process_group
    if init is not Collective.init_process_group and _may_raise_not_implemented(init):
        _probe_init(coll, probe)
    order = {(m.interface, m.method): n for n, m in enumerate(METHODS)}
    return sorted(found.values(), key=lambda e: order.get((e["interface"], e["method"]), len(order)))


def _may_raise_not_implemented(fn) -> bool:
    """Whether ``fn`` names NotImplementedError, itself or in a module function it calls (a
    scaffold's ``_todo``). A finished override is then never run: joining a process group
    is not free on real hardware."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    if "NotImplementedError" in code.co_names:
        return True
    scope = getattr(fn, "__globals__", {})
    return any("NotImplementedError" in getattr(getattr(scope.get(n), "__code__", None), "co_names", ())
               for n in code.co_names)


def _probe_init(coll, probe) -> None:
    """An overridden ``init_process_group``: join a private world of one and leave it again,
    only where that cannot touch a real job (no group yet, no launcher rendezvous)."""
    import torch.distributed as dist

    if dist.is_initialized() or "MASTER_ADDR" in os.environ:
        return
    if probe("Collective", "init_process_group", lambda: coll.init_process_group(rank=0, world_size=1)) is not None:
        coll.destroy()
    elif dist.is_initialized():
        dist.destroy_process_group()
