"""Find model families: built in, from the ``chipset.models`` entry points, or ``module:factory``.

Like backends (chipset.discovery.records), a family package that fails to import or whose
factory raises is isolated: the problem is recorded and shown by ``chipset models``, and every
other family keeps working. Selecting a broken family is a usage error (exit 2) naming why.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from dataclasses import dataclass

import importlib_metadata

from chipset.errors import ConfigError
from chipset.models.family import ModelFamily, TransformerFamily

__all__ = ["ENTRY_POINT_GROUP", "FamilyRecord", "discover_families", "resolve_family"]

ENTRY_POINT_GROUP = "chipset.models"
log = logging.getLogger(__name__)


@dataclass
class FamilyRecord:
    """One family and whether it can be used."""

    name: str
    status: str  # ok, import-error, factory-error
    reason: str
    source: str  # "built-in" or the entry point "name = module:attr"
    distribution: str | None = None
    family: ModelFamily | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        fam = self.family
        return {"name": self.name, "status": self.status, "reason": self.reason, "source": self.source,
                "distribution": self.distribution,
                "layouts": sorted(fam.layouts) if fam is not None else None}


def _call_factory(obj, where: str) -> ModelFamily:
    fam = obj() if callable(obj) and not isinstance(obj, ModelFamily) else obj
    if not callable(getattr(fam, "build", None)):
        raise TypeError(f"{where} returned {type(fam).__name__}, expected a model family "
                        "(an object with build(cfg), see chipset.models.family.ModelFamily)")
    return fam


def _one(ep) -> FamilyRecord:
    dist = getattr(ep, "dist", None)
    rec = FamilyRecord(name=ep.name, status="ok", reason="", source=f"{ep.name} = {ep.value}",
                       distribution=dist.metadata["Name"] if dist is not None else None)
    try:
        obj = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken package must not break the others
        rec.status, rec.reason, rec.traceback = "import-error", f"{type(exc).__name__}: {exc}", traceback.format_exc()
    else:
        try:
            rec.family = _call_factory(obj, ep.value)
        except Exception as exc:  # noqa: BLE001
            rec.status, rec.reason = "factory-error", f"{type(exc).__name__}: {exc}"
            rec.traceback = traceback.format_exc()
    if not rec.ok:
        log.warning("model family %r (%s) is unusable: %s", rec.name, rec.source, rec.reason)
    return rec


def _builtins() -> dict[str, ModelFamily]:
    """Families shipped in chipset: the decoder, a GPT-2-style decoder (chipset.models.gpt2) and
    the ResNet example (chipset.models.resnet)."""
    from chipset.models.gpt2 import GPT2Family
    from chipset.models.resnet import ResNetFamily

    return {"transformer": TransformerFamily(), "gpt2": GPT2Family(), "resnet": ResNetFamily()}


def discover_families() -> list[FamilyRecord]:
    """The built-in families first, then every ``chipset.models`` entry point, sorted by name."""
    builtins = _builtins()
    out = [FamilyRecord(name, "ok", "", "built-in", "chipset", fam) for name, fam in builtins.items()]
    eps = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    out += [_one(ep) for ep in eps if ep.name not in builtins]
    return out


def resolve_family(spec: str) -> ModelFamily:
    """The family ``model.family = spec`` names. ConfigError (exit 2) says why one cannot be had."""
    spec = spec or "transformer"
    builtins = _builtins()
    if spec in builtins:
        return builtins[spec]
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"model.family = {spec!r}: cannot load it ({type(exc).__name__}: {exc}); "
                              "expected package.module:factory importable on PYTHONPATH") from exc
        try:
            return _call_factory(obj, spec)
        except Exception as exc:  # noqa: BLE001 - user code: report, do not crash
            raise ConfigError(f"model.family = {spec!r}: the factory failed ({type(exc).__name__}: {exc})") from exc
    recs = {r.name: r for r in discover_families()}
    rec = recs.get(spec)
    if rec is None:
        raise ConfigError(f"model.family = {spec!r}: no such family; installed: {', '.join(sorted(recs))} "
                          "(chipset models lists them), or give package.module:factory")
    if not rec.ok:
        raise ConfigError(f"model.family = {spec!r} is unusable ({rec.status}: {rec.reason}); "
                          "see chipset models -v")
    return rec.family
