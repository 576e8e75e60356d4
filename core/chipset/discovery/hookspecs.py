"""The hook contract of plugin API 1.0, deprecated: new plugins return a ``BackendSpec``.

A 1.0 backend's ``load()`` returns an object (usually its implementation module) carrying
``@chipset.hookimpl`` functions. Such plugins keep loading on every 1.x core
(``chipset.discovery.legacy`` turns the hooks into a :class:`chipset.BackendSpec`, with a
``DeprecationWarning``); the path goes with plugin API 2.0. Hooks are validated when the
plugin is loaded: a hook that is not in this module, or whose parameters differ from the
spec, is refused with a message that quotes the signature. ``chipset_device``,
``chipset_memory``, ``chipset_collective`` and ``chipset_capabilities`` are required.
Each hook has its field in ``BackendSpec`` (``chipset_device`` is ``device``, ...).
"""

from __future__ import annotations

import pluggy

PROJECT = "chipset"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("chipset_device", "chipset_memory", "chipset_collective", "chipset_capabilities")


@hookspec(firstresult=True)
def chipset_device():
    """Return the backend's :class:`chipset.interfaces.Device`. First non-None result wins."""


@hookspec(firstresult=True)
def chipset_memory(device):
    """Return the :class:`chipset.interfaces.Memory` for ``device``. First non-None result wins."""


@hookspec(firstresult=True)
def chipset_collective(device):
    """Return the :class:`chipset.interfaces.Collective` for ``device``. First non-None result wins."""


@hookspec(firstresult=True)
def chipset_capabilities(device):
    """Return the backend's :class:`chipset.interfaces.Capabilities`. First non-None result wins.

    ``kernels`` is filled in by core from what ``chipset_register_kernels`` registered.
    """


@hookspec
def chipset_register_kernels(registry, device):
    """Register kernel implementations on ``registry`` (a KernelRegistry). Every plugin is called; returns nothing."""


@hookspec
def chipset_launch_env(local_rank, local_world_size):
    """Return a dict of environment variables a launcher sets for one local rank (e.g. visible devices).

    Every plugin is called; the dicts are merged in call order.
    """
