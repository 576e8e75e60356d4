"""Load a selected backend through pluggy and bundle its interfaces."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import pluggy

from chipset.discovery import hookspecs
from chipset.discovery.records import BackendRecord, discover
from chipset.discovery.select import Selection, select
from chipset.errors import PluginValidationError
from chipset.interfaces import Capabilities, Collective, Device, Memory
from chipset.kernels import KernelRegistry

__all__ = ["Backend", "backend", "list_backends", "load_backend"]


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
    plugin_manager: pluggy.PluginManager

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Environment variables a launcher sets for one local rank."""
        env: dict[str, str] = {}
        for part in reversed(self.plugin_manager.hook.chipset_launch_env(local_rank=local_rank, local_world_size=local_world_size)):
            env.update(part or {})
        return env

    def __repr__(self) -> str:
        return f"Backend(name={self.name!r}, devices={self.device.device_count()})"


_loaded: dict[str, Backend] = {}
_lock = threading.Lock()


def _kernel_owners(records: list[BackendRecord]):
    def owners(kernel: str) -> list[str]:
        return [r.name for r in records if r.descriptor is not None and kernel in r.descriptor.kernels]

    return owners


def _validate(pm: pluggy.PluginManager, plugin: object, rec: BackendRecord) -> None:
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginValidationError(f"backend {rec.name!r} ({rec.entry_point}): {exc}") from exc
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not pm.hook.__dict__[h].get_hookimpls()]
    if missing:
        raise PluginValidationError(
            f"backend {rec.name!r} ({rec.entry_point}) does not implement required hook(s) "
            f"{', '.join(missing)}; see chipset.discovery.hookspecs for their signatures."
        )


def load_backend(sel: Selection, records: list[BackendRecord] | None = None) -> Backend:
    """Load the backend of ``sel`` (uncached)."""
    rec = sel.record
    assert rec.descriptor is not None  # only ok records are selected
    plugin = rec.descriptor.load()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(plugin, name=rec.name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        sig = ""
        hookimpl = getattr(exc, "plugin", None)
        if hookimpl is not None:
            sig = f" (plugin {hookimpl!r})"
        raise PluginValidationError(f"backend {rec.name!r} ({rec.entry_point}) has invalid hooks{sig}: {exc}") from exc
    _validate(pm, plugin, rec)
    device = pm.hook.chipset_device()
    memory = pm.hook.chipset_memory(device=device)
    collective = pm.hook.chipset_collective(device=device)
    caps = pm.hook.chipset_capabilities(device=device)
    for what, obj, cls in (("device", device, Device), ("memory", memory, Memory), ("collective", collective, Collective), ("capabilities", caps, Capabilities)):
        if not isinstance(obj, cls):
            raise PluginValidationError(
                f"backend {rec.name!r}: hook chipset_{what} must return a {cls.__module__}.{cls.__name__}, "
                f"found {type(obj).__name__}"
            )
    registry = KernelRegistry(rec.name, _kernel_owners(records if records is not None else discover()))
    pm.hook.chipset_register_kernels(registry=registry, device=device)
    own = tuple(sorted(n for n in registry.names() if registry.implementations(n)))
    caps = dataclasses.replace(caps, kernels=own)
    return Backend(rec.name, device, memory, collective, registry, caps, sel.reason, rec, pm)


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

