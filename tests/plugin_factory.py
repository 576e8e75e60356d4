"""Build real, installed plugin distributions in a temporary directory.

Each call writes a package and a ``<name>-<version>.dist-info`` folder with METADATA and
``entry_points.txt`` into one site directory: exactly what ``pip install`` leaves behind.
Put the directory on ``sys.path`` (or ``PYTHONPATH`` of a subprocess) and chipset's
discovery finds them through importlib-metadata like any vendor package.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

GOOD_SPEC = '''
from chipset.discovery.spec import BackendSpec
from chipset.interfaces import Capabilities
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import SimDevice
from chipset_cpu_sim.memory import SimMemory


class _Device(SimDevice):
    backend_name = "{name}"


def register_kernels(registry, device):
    ref = registry.reference("swiglu")
    registry.register("swiglu", lambda gate, up: ref(gate, up), priority=5, description="{name} swiglu")


spec = BackendSpec(name="{name}", device=_Device, memory=SimMemory, collective=SimCollective,
                   capabilities=Capabilities(dtypes=("float32",)), register_kernels=register_kernels)
'''
"""The implementation module of a working plugin (``load()`` returns its ``spec``)."""

LEGACY_HOOKS = '''
from chipset.discovery.hookspecs import hookimpl
from chipset.interfaces import Capabilities
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import SimDevice
from chipset_cpu_sim.memory import SimMemory


class _Device(SimDevice):
    backend_name = "{name}"


@hookimpl
def chipset_device():
    return _Device()


@hookimpl
def chipset_memory(device):
    return SimMemory(device)


@hookimpl
def chipset_collective(device):
    return SimCollective(device)


@hookimpl
def chipset_capabilities(device):
    return Capabilities(dtypes=("float32",))


@hookimpl
def chipset_register_kernels(registry, device):
    ref = registry.reference("swiglu")
    registry.register("swiglu", lambda gate, up: ref(gate, up), priority=5, description="{name} swiglu")
'''
"""The same plugin written with plugin API 1.0's deprecated hooks (``load()`` returns the module)."""


def make_plugin(
    site: Path,
    name: str,
    *,
    dist: str | None = None,
    priority: int = 50,
    api_version: tuple[int, int] | None = None,
    simulator: bool = False,
    probe_body: str = "return True, 'test device present'",
    module_prelude: str = "",
    impl: str | None = None,
    legacy: bool = False,
    entry_value: str | None = None,
    version: str = "1.0.0",
) -> str:
    """Install a backend plugin distribution called ``dist`` (default ``chipset-<name>``) into ``site``.

    ``impl`` is the text of its implementation module (``plugin_<name>/backend.py``, default
    :data:`GOOD_SPEC`); the descriptor's ``load()`` returns that module's ``spec``, or with
    ``legacy`` the module itself (default text :data:`LEGACY_HOOKS`). ``api_version`` defaults
    to the API the form needs: 1.0 for hooks, 1.1 for a spec.
    """
    if api_version is None:
        api_version = (1, 0) if legacy else (1, 1)
    dist = dist or f"chipset-{name.replace('_', '-')}"
    pkg = f"plugin_{name}"
    pdir = site / pkg
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            {module_prelude}
            from chipset.discovery.descriptor import BackendDescriptor


            def _probe():
                {probe_body}


            def _load():
                from {pkg} import backend
                return {"backend" if legacy else "backend.spec"}


            descriptor = BackendDescriptor(
                name={name!r}, api_version={tuple(api_version)!r}, priority={priority},
                probe=_probe, load=_load, simulator={simulator},
            )
            """
        )
    )
    if impl is None:
        impl = (LEGACY_HOOKS if legacy else GOOD_SPEC).format(name=name)
    (pdir / "backend.py").write_text(impl)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[chipset.backends]\n{name} = {entry_value or pkg + ':descriptor'}\n"
    )
    (info / "top_level.txt").write_text(pkg + "\n")
    return dist
