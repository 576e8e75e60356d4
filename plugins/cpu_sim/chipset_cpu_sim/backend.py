"""cpu_sim's backend spec: the only module chipset loads from this plugin."""

from __future__ import annotations

from chipset.discovery.spec import BackendSpec
from chipset.interfaces import Capabilities
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import SimDevice
from chipset_cpu_sim.memory import SimMemory

CAPABILITIES = Capabilities(
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

# The simulator is the yardstick: it runs the core references and registers no kernel, and
# every rank sees all simulated devices and binds to its local rank, as on GPUs (no launch env).
spec = BackendSpec(
    name="cpu_sim",
    device=SimDevice,
    memory=SimMemory,
    collective=SimCollective,
    capabilities=CAPABILITIES,
)
