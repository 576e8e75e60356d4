"""cpu's backend spec: the only module chipset loads from this plugin."""

from __future__ import annotations

import os

from chipset.discovery.spec import BackendSpec
from chipset.interfaces import Capabilities
from chipset_cpu import kernels
from chipset_cpu.collective import CpuCollective
from chipset_cpu.device import CpuDevice
from chipset_cpu.memory import CpuMemory

CAPABILITIES = Capabilities(
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


def register_kernels(registry, device) -> None:
    kernels.register(registry)


def launch_env(local_rank: int, local_world_size: int) -> dict[str, str]:
    # Ranks on one host share its cores: without a limit each rank's intra-op pool takes
    # every core and the ranks oversubscribe them. A user's own setting wins.
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))}


spec = BackendSpec(
    name="cpu",
    device=CpuDevice,
    memory=CpuMemory,
    collective=CpuCollective,
    capabilities=CAPABILITIES,
    register_kernels=register_kernels,
    launch_env=launch_env,
)
