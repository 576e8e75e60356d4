"""The deprecated hook path: a plugin object carrying ``@chipset.hookimpl`` functions.

Plugins built against plugin API 1.0 return such an object from ``load()`` (the hooks are
specified in :mod:`chipset.discovery.hookspecs`). They keep loading for every 1.x core: the
hooks are validated through pluggy as before and turned into a :class:`BackendSpec`, so
the loader has one path. The path goes with plugin API 2.0; a plugin moves to it by
returning a ``BackendSpec`` from ``load()`` (docs/writing-a-plugin.md §4 The hooks).
"""

from __future__ import annotations

import pluggy

from chipset.discovery import hookspecs
from chipset.discovery.spec import BackendSpec
from chipset.errors import PluginValidationError

__all__ = ["has_hooks", "spec_from_hooks", "undecorated_hooks"]

_MARK = f"{hookspecs.PROJECT}_impl"  # the attribute pluggy's HookimplMarker sets on a function


def has_hooks(plugin: object) -> bool:
    """Whether ``plugin`` carries at least one ``@chipset.hookimpl`` function."""
    return any(hasattr(getattr(plugin, n, None), _MARK) for n in dir(plugin) if not n.startswith("__"))


def undecorated_hooks(plugin: object) -> list[str]:
    """Functions of ``plugin`` named like a hook but not marked with ``@chipset.hookimpl``."""
    return sorted(n for n in dir(plugin) if n.startswith("chipset_") and callable(getattr(plugin, n, None))
                  and not hasattr(getattr(plugin, n), _MARK))


def spec_from_hooks(plugin: object, name: str, where: str) -> BackendSpec:
    """The spec a hook plugin amounts to; its hooks are validated first (``where`` names the
    backend's entry point in errors)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginValidationError(f"backend {name!r} ({where}) has invalid hooks: {exc}") from exc
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not getattr(pm.hook, h).get_hookimpls()]
    if missing:
        raise PluginValidationError(
            f"backend {name!r} ({where}) does not implement required hook(s) "
            f"{', '.join(missing)}; see chipset.discovery.hookspecs for their signatures, or return a "
            "chipset.BackendSpec from load() instead (docs/writing-a-plugin.md §4 The hooks)."
        )
    hook = pm.hook

    def launch_env(local_rank: int, local_world_size: int) -> dict[str, str]:
        env: dict[str, str] = {}
        for part in reversed(hook.chipset_launch_env(local_rank=local_rank, local_world_size=local_world_size)):
            env.update(part or {})
        return env

    return BackendSpec(
        name=name,
        device=lambda: hook.chipset_device(),
        memory=lambda device: hook.chipset_memory(device=device),
        collective=lambda device: hook.chipset_collective(device=device),
        capabilities=lambda device: hook.chipset_capabilities(device=device),
        register_kernels=lambda registry, device: hook.chipset_register_kernels(registry=registry, device=device),
        launch_env=launch_env,
    )
