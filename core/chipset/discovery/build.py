"""Which installed backends could serve the installed torch build (``chipset backends``).

Asked through torch's device-neutral surface only: ``torch.accelerator.current_accelerator()``
names the build's accelerator device type (None for a CPU-only build) without initialising a
device. A vendor package that registers its device type when imported (a PrivateUse1 device)
is seen only once it is imported; its backend's probe says whether it is there.
"""

from __future__ import annotations

import torch

from chipset.discovery.records import BackendRecord

__all__ = ["build_report"]


def build_report(records: list[BackendRecord]) -> dict:
    """{"torch", "accelerator", "could_serve", "other_builds"}: the build's accelerator device
    type and, by each backend's ``device_types``, the backends that drive it (or the host),
    and those that need another torch build or a vendor package."""
    acc = torch.accelerator.current_accelerator()
    kind = None if acc is None else acc.type
    serve, other = [], []
    for rec in records:
        types = rec.descriptor.device_types if rec.descriptor is not None else ()
        if not types:
            continue
        fits = "cpu" in types or (kind is not None and (kind in types or "*" in types))
        (serve if fits else other).append({"backend": rec.name, "device_types": list(types), "status": rec.status})
    return {"torch": torch.__version__, "accelerator": kind, "could_serve": serve, "other_builds": other}


def explain(report: dict) -> list[str]:
    """The report as lines for the terminal."""
    kind = report["accelerator"]
    head = (f"torch {report['torch']}: accelerator {kind!r} (torch.accelerator)" if kind else
            f"torch {report['torch']}: no accelerator in this build (torch.accelerator reports none)")
    lines = [head]

    def names(rows):
        return ", ".join(f"{r['backend']} ({r['status']})" for r in rows) or "none"

    lines.append(f"  could serve it: {names(report['could_serve'])}")
    if report["other_builds"]:
        wants = ", ".join(f"{r['backend']} ({'/'.join(t if t != '*' else 'any accelerator' for t in r['device_types'])})"
                          for r in report["other_builds"])
        lines.append(f"  need another torch build or vendor package: {wants}")
    return lines
