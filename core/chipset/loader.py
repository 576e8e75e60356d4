"""Build a selected backend from its spec and bundle its interfaces."""

from __future__ import annotations

import dataclasses
import threading
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from chipset.discovery import legacy
from chipset.discovery.records import BackendRecord, discover
from chipset.discovery.select import Selection, select
from chipset.discovery.spec import BackendSpec
from chipset.errors import PluginValidationError
from chipset.interfaces import Capabilities, Collective, Device, Memory
from chipset.kernels import KernelRegistry

__all__ = ["Backend", "backend", "list_backends", "load_backend", "spec_of"]


@dataclass
class Backend:
    """A loaded backend: its name and the interfaces the engine uses."""

    name: str
    device: Device
    memory: Memory
    collective: Collective
    kernels: KernelRegistry
    capabilities: Capabilities
    selection_reason: str
    record: BackendRecord
    spec: BackendSpec

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Environment variables a launcher sets for one local rank."""
        if self.spec.launch_env is None:
            return {}
        env = self.spec.launch_env(local_rank, local_world_size)
        if env is None:
            return {}
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise PluginValidationError(
                f"backend {self.name!r}: launch_env must return a dict of str to str (environment variables), "
                f"found {env!r}; fix the launch_env function of its BackendSpec"
            )
        return dict(env)

    def __repr__(self) -> str:
        return f"Backend(name={self.name!r}, devices={self.device.device_count()})"


_loaded: dict[str, Backend] = {}
_lock = threading.Lock()


def _kernel_owners(records: list[BackendRecord]):
    def owners(kernel: str) -> list[str]:
        return [r.name for r in records if r.descriptor is not None and kernel in r.descriptor.kernels]

    return owners


def spec_of(rec: BackendRecord) -> BackendSpec:
    """Call the descriptor's ``load()`` and return the backend's spec: the
    :class:`BackendSpec` it returns or, deprecated, the one its ``@hookimpl`` functions amount to."""
    assert rec.descriptor is not None  # only ok records are loaded
    try:
        loaded = rec.descriptor.load()
    except PluginValidationError as exc:  # e.g. a BackendSpec(...) with a bad field
        raise PluginValidationError(f"backend {rec.name!r} ({rec.entry_point}): {exc}") from exc
    if isinstance(loaded, BackendSpec):
        if loaded.name != rec.name:
            raise PluginValidationError(
                f"backend {rec.name!r} ({rec.entry_point}): load() returned the BackendSpec of {loaded.name!r}; "
                f"the spec's name must equal the descriptor's ({rec.name!r})"
            )
        return loaded
    if legacy.has_hooks(loaded):
        warnings.warn(
            f"chipset backend {rec.name!r} ({rec.distribution or rec.entry_point}) provides @chipset.hookimpl "
            "functions: this path is deprecated and goes with plugin API 2.0; return a chipset.BackendSpec "
            "from load() instead (docs/writing-a-plugin.md §4 The hooks)",
            DeprecationWarning,
            stacklevel=4,  # the caller of chipset.backend()
        )
        return legacy.spec_from_hooks(loaded, rec.name, rec.entry_point)
    named = legacy.undecorated_hooks(loaded)
    hint = f" (not marked @chipset.hookimpl: {', '.join(named)})" if named else ""
    raise PluginValidationError(
        f"backend {rec.name!r} ({rec.entry_point}): its descriptor's load() must return a chipset.BackendSpec, "
        f"found {type(loaded).__name__} {_short(loaded)} with no @chipset.hookimpl function either{hint}. "
        "Return BackendSpec(name=..., device=..., memory=..., collective=..., capabilities=...) from load() "
        "(docs/writing-a-plugin.md §4 The hooks)."
    )


def _short(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return repr(obj.__name__)
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _built(spec: BackendSpec, what: str, obj: object, cls: type) -> object:
    if not isinstance(obj, cls):
        raise PluginValidationError(
            f"backend {spec.name!r}: BackendSpec.{what} must give a {cls.__module__}.{cls.__name__}, "
            f"found {type(obj).__name__}"
        )
    return obj


def load_backend(sel: Selection, records: list[BackendRecord] | None = None) -> Backend:
    """Load the backend of ``sel`` (uncached)."""
    rec = sel.record
    spec = spec_of(rec)
    device = _built(spec, "device", spec.device(), Device)
    memory = _built(spec, "memory", spec.memory(device), Memory)
    collective = _built(spec, "collective", spec.collective(device), Collective)
    caps = spec.capabilities(device) if callable(spec.capabilities) else spec.capabilities
    caps = _built(spec, "capabilities", caps, Capabilities)
    registry = KernelRegistry(rec.name, _kernel_owners(records if records is not None else discover()))
    if spec.register_kernels is not None:
        spec.register_kernels(registry, device)
    own = tuple(sorted(n for n in registry.names() if registry.implementations(n)))
    caps = dataclasses.replace(caps, kernels=own)
    return Backend(rec.name, device, memory, collective, registry, caps, sel.reason, rec, spec)


def backend(name: str | None = None) -> Backend:
    """The selected backend: ``name``, else ``CHIPSET_BACKEND``, else by priority. Loaded once per process."""
    records = discover()
    sel = select(name, records)
    with _lock:
        if sel.record.name not in _loaded:
            _loaded[sel.record.name] = load_backend(sel, records)
        b = _loaded[sel.record.name]
    return b


def list_backends(refresh: bool = False) -> list[BackendRecord]:
    """Every installed backend with its status and reason (nothing is loaded)."""
    return discover(refresh=refresh)

