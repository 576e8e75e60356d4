"""Run in a fresh interpreter: import one backend's descriptor and probe it, report what happened.

``python -m chipset.conformance._isolation NAME`` prints one JSON object:
``foreign_modules`` (top-level modules the descriptor import pulled in that are neither
the standard library, chipset and its own dependencies, nor the plugin's own package),
``probe`` ((ok, reason) or the exception), ``device_initialized`` (the descriptor's
answer after the probe, or None when it declares no way to tell) and
``accelerator_allocator_initialized`` (torch's generic flag, where torch has one).
"""

from __future__ import annotations

import json
import sys

# chipset itself imports these; a descriptor is not blamed for them.
_CORE_DEPS = {"chipset", "torch", "pluggy", "importlib_metadata", "numpy", "zipp", "typing_extensions",
              "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "packaging"}


def main(name: str) -> dict:
    import importlib_metadata

    import chipset  # noqa: F401  (core and torch are allowed)
    from chipset.discovery.records import ENTRY_POINT_GROUP

    eps = [e for e in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == name]
    if not eps:
        return {"error": f"no entry point named {name!r} in group {ENTRY_POINT_GROUP}"}
    ep = eps[0]
    own = {ep.module.split(".")[0]}
    dist = getattr(ep, "dist", None)
    if dist is not None:
        top = dist.read_text("top_level.txt") or ""
        own |= {t.strip() for t in top.splitlines() if t.strip()}
    before = set(sys.modules)
    desc = ep.load()
    new = {m.split(".")[0] for m in set(sys.modules) - before}
    allowed = set(sys.stdlib_module_names) | _CORE_DEPS | own
    foreign = sorted(m for m in new if m not in allowed and not m.startswith("_"))
    out: dict = {"foreign_modules": foreign, "own_packages": sorted(own)}
    try:
        ok, reason = desc.probe()
        out["probe"] = [bool(ok), str(reason)]
    except Exception as exc:  # reported, not raised: the caller judges
        out["probe_error"] = f"{type(exc).__name__}: {exc}"
    fn = getattr(desc, "device_initialized", None)
    out["device_initialized"] = None if fn is None else bool(fn())
    import torch

    flag = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
    try:
        out["accelerator_allocator_initialized"] = None if flag is None else bool(flag())
    except RuntimeError:  # no accelerator in this torch build: nothing can be initialised
        out["accelerator_allocator_initialized"] = None
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
