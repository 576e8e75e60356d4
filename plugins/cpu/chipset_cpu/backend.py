"""cpu's hook implementations: the only module chipset loads from this plugin."""

from __future__ import annotations

import os

from chipset.discovery.hookspecs import hookimpl
from chipset.interfaces import Capabilities
from chipset_cpu import kernels
from chipset_cpu.collective import CpuCollective
from chipset_cpu.device import CpuDevice
from chipset_cpu.memory import CpuMemory


@hookimpl
def chipset_device():
    return CpuDevice()


@hookimpl
def chipset_memory(device):
    return CpuMemory(device)


@hookimpl
def chipset_collective(device):
    return CpuCollective(device)


@hookimpl
def chipset_capabilities(device):
    return Capabilities(
        dtypes=("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"),
        amp_dtypes=("bfloat16",),
        collective_dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
        streams=False,
        event_timing=True,
        graph_capture=False,
        memory_capacity_enforced=False,
        memory_accounting="process",
        pinned_memory=False,
        multi_process=True,
        ranks_share_device=True,
    )


@hookimpl
def chipset_register_kernels(registry, device):
    kernels.register(registry)


@hookimpl
def chipset_launch_env(local_rank, local_world_size):
    # Ranks on one host share its cores: without a limit each rank's intra-op pool takes
    # every core and the ranks oversubscribe them. A user's own setting wins.
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))}
