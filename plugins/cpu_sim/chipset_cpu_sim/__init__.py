"""chipset-cpu-sim: the descriptor. Importing this module imports nothing heavy."""

from __future__ import annotations

import sys

from chipset.discovery.descriptor import BackendDescriptor


def _probe() -> tuple[bool, str]:
    # The simulator needs nothing but the host; it is always available.
    return True, "simulated devices on the host CPU (always available)"


def _device_initialized() -> bool:
    # Simulated devices come into being when the implementation module is loaded.
    return "chipset_cpu_sim.backend" in sys.modules


def _profiles():
    from chipset_cpu_sim.profiles import descriptor_profiles

    return descriptor_profiles()


def _load():
    from chipset_cpu_sim import backend

    return backend.spec


descriptor = BackendDescriptor(
    name="cpu_sim",
    api_version=(1, 1),
    priority=0,
    device_types=("cpu",),
    probe=_probe,
    load=_load,
    simulator=True,
    profiles=_profiles,
    device_initialized=_device_initialized,
    compile_backend=None,  # the per-op memory accounting must see every eager op
    description="Simulated accelerators on the CPU: memory accounting, real gloo collectives.",
)
