"""Versions: the package release and the plugin API that plugins negotiate against."""

from __future__ import annotations

__version__ = "0.1.0"

#: The plugin API this core serves, as (major, minor). A plugin built against
#: (M, m) is accepted when M equals the core's major and m <= the core's minor.
#: 1.1: ``load()`` may return a ``BackendSpec`` (1.0's hook objects still load, deprecated).
API_VERSION: tuple[int, int] = (1, 1)


def api_compatible(plugin: tuple[int, int], core: tuple[int, int] = API_VERSION) -> tuple[bool, str]:
    """Return (ok, reason) for a plugin built against ``plugin`` running on ``core``."""
    pmaj, pmin = plugin
    cmaj, cmin = core
    if pmaj != cmaj:
        return False, (
            f"plugin API {pmaj}.{pmin} has a different major version than core API {cmaj}.{cmin}; "
            f"install a plugin release built for API {cmaj}.x"
        )
    if pmin > cmin:
        return False, (
            f"plugin needs API {pmaj}.{pmin} but this chipset core provides {cmaj}.{cmin}; "
            "upgrade chipset"
        )
    return True, f"API {pmaj}.{pmin} is served by core {cmaj}.{cmin}"
