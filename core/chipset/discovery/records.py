"""Discover installed backends from the ``chipset.backends`` entry-point group.

Each entry point yields a :class:`BackendRecord` with a status. A plugin that fails to
import or whose probe raises is isolated: its traceback is kept, a warning goes to
stderr, and every other backend keeps working.
"""

from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass

import importlib_metadata

from chipset._version import API_VERSION, api_compatible
from chipset.discovery.descriptor import BackendDescriptor

__all__ = ["BackendRecord", "ChipsetPluginWarning", "discover", "ENTRY_POINT_GROUP", "STATUSES"]

ENTRY_POINT_GROUP = "chipset.backends"
STATUSES = ("ok", "unavailable", "import-error", "probe-error", "incompatible-api", "disabled")


class ChipsetPluginWarning(UserWarning):
    """A chipset plugin failed to import or probe; it is isolated and shown by ``chipset backends``."""


@dataclass
class BackendRecord:
    """One discovered backend and why it can or cannot be used."""

    name: str
    status: str
    reason: str
    entry_point: str
    distribution: str | None = None
    version: str | None = None
    api_version: str | None = None
    priority: int | None = None
    simulator: bool = False
    descriptor: BackendDescriptor | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "distribution": self.distribution,
            "version": self.version,
            "api_version": self.api_version,
            "priority": self.priority,
            "entry_point": self.entry_point,
        }


def _disabled_set() -> set[str]:
    raw = os.environ.get("CHIPSET_DISABLE_PLUGINS", "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def _one(ep) -> BackendRecord:
    dist = getattr(ep, "dist", None)
    rec = BackendRecord(
        name=ep.name,
        status="ok",
        reason="",
        entry_point=f"{ep.name} = {ep.value}",
        distribution=dist.metadata["Name"] if dist is not None else None,
        version=dist.version if dist is not None else None,
    )
    disabled = _disabled_set()
    if ep.name in disabled or (rec.distribution and rec.distribution in disabled):
        rec.status, rec.reason = "disabled", "listed in CHIPSET_DISABLE_PLUGINS"
        return rec
    try:
        desc = ep.load()
    except BaseException as exc:  # noqa: BLE001 - a broken plugin must not take chipset down
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _fail(rec, "import-error", f"importing {ep.value} raised {type(exc).__name__}: {exc}")
    if not isinstance(desc, BackendDescriptor):
        return _fail(
            rec, "import-error",
            f"entry point {ep.value} must be a chipset.BackendDescriptor, found {type(desc).__name__}",
            with_traceback=False,
        )
    rec.descriptor = desc
    rec.priority = desc.priority
    rec.simulator = desc.simulator
    try:
        rec.api_version = f"{int(desc.api_version[0])}.{int(desc.api_version[1])}"
        ok, why = api_compatible((int(desc.api_version[0]), int(desc.api_version[1])))
    except (TypeError, ValueError, IndexError):
        ok, why = False, f"api_version must be (major, minor) integers, found {desc.api_version!r}"
    if not ok:
        rec.status, rec.reason = "incompatible-api", why
        return rec
    if desc.name != ep.name:
        rec.status = "import-error"
        rec.reason = f"entry point is named {ep.name!r} but its descriptor says {desc.name!r}; they must match"
        return rec
    try:
        available, reason = desc.probe()
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _fail(rec, "probe-error", f"probe raised {type(exc).__name__}: {exc}")
    rec.status = "ok" if available else "unavailable"
    rec.reason = str(reason)
    return rec


def _fail(rec: BackendRecord, status: str, reason: str, with_traceback: bool = True) -> BackendRecord:
    rec.status, rec.reason = status, reason
    if with_traceback:
        rec.traceback = traceback.format_exc()
    warnings.warn(
        f"chipset backend {rec.name!r} ({rec.distribution or 'unknown distribution'}) is isolated: "
        f"{status}: {reason}. Other backends keep working; see `chipset backends`.",
        ChipsetPluginWarning,
        stacklevel=3,
    )
    return rec


_cache: dict[tuple, list[BackendRecord]] = {}


def discover(refresh: bool = False) -> list[BackendRecord]:
    """Every installed backend, sorted by name. Cached per process unless ``refresh``."""
    key = (os.environ.get("CHIPSET_DISABLE_PLUGINS", ""), API_VERSION)
    if refresh or key not in _cache:
        eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        seen: set[tuple[str, str]] = set()
        records = []
        for ep in eps:
            # The same distribution can be visible twice on sys.path; count it once.
            dist = getattr(ep, "dist", None)
            ident = (ep.name, ep.value, dist.metadata["Name"] if dist is not None else None)
            if ident in seen:
                continue
            seen.add(ident)
            records.append(_one(ep))
        _cache[key] = sorted(records, key=lambda r: r.name)
    return _cache[key]


def clear_cache() -> None:
    _cache.clear()
