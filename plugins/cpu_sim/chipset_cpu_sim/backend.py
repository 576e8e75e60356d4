"""cpu_sim's hook implementations: the only module chipset loads from this plugin."""

from __future__ import annotations

from chipset.discovery.hookspecs import hookimpl
from chipset.interfaces import Capabilities
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import SimDevice
from chipset_cpu_sim.memory import SimMemory


@hookimpl
def chipset_device():
    return SimDevice()


@hookimpl
def chipset_memory(device):
    return SimMemory(device)


@hookimpl
def chipset_collective(device):
    return SimCollective(device)


@hookimpl
def chipset_capabilities(device):
    return Capabilities(
        dtypes=("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"),
        amp_dtypes=("bfloat16", "float16"),
        collective_dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
        streams=True,
        event_timing=True,
        graph_capture=False,
        memory_capacity_enforced=True,
        pinned_memory=False,
        multi_process=True,
        ranks_share_device=True,
        fp8=("tensorwise", "rowwise"),  # the core's emulation (kernels/fp8.py): the yardstick
    )


@hookimpl
def chipset_register_kernels(registry, device):
    # The simulator is the yardstick: it runs the core references and adds nothing.
    return None


@hookimpl
def chipset_launch_env(local_rank, local_world_size):
    # Every rank sees all simulated devices and binds to its local rank, as on GPUs.
    return {}
