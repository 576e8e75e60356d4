"""chipset-accelerator's backend spec: the generic backend for the accelerator torch reports.

Capabilities are declared from what the device module answers, never from the device
type's name: streams and event timing where it has ``Stream``/``Event``, bfloat16 where
``is_bf16_supported()`` says so, several processes where torch names a collective
backend for the type, exact memory accounting where it has the caching allocator's
``memory_stats``, capacity enforcement where it reports ``mem_get_info``.
"""

from __future__ import annotations

from chipset.discovery.spec import BackendSpec
from chipset.interfaces import ALL_COLLECTIVES, Capabilities, dtype_name
from chipset_accelerator import distributed_backend
from chipset_accelerator.collective import AcceleratorCollective
from chipset_accelerator.device import AcceleratorDevice
from chipset_accelerator.memory import AcceleratorMemory


def capabilities_for(device: AcceleratorDevice) -> Capabilities:
    module = device.module
    dtypes = tuple(dtype_name(d) for d in device.supported_dtypes)
    half = tuple(d for d in ("bfloat16", "float16") if d in dtypes)
    streams = device.has_streams()
    multi = distributed_backend(device.accelerator_type) is not None
    return Capabilities(
        dtypes=dtypes,
        amp_dtypes=half,
        collectives=ALL_COLLECTIVES if multi else (),
        collective_dtypes=("float32", *half, "int32", "int64") if multi else (),
        streams=streams,
        event_timing=streams,
        graph_capture=False,  # torch.accelerator.Graph is new; chipset does not drive it yet
        memory_capacity_enforced=hasattr(module, "mem_get_info"),
        memory_accounting="exact" if hasattr(module, "memory_stats") else "process",
        pinned_memory=True,
        multi_process=multi,
    )


# No kernels are registered: a fused kernel's agreement with the reference is per device and
# must be measured there; the core references run on any device torch has kernels for. Every
# rank sees every device and binds to its local rank, so there is no launch env either.
spec = BackendSpec(
    name="accelerator",
    device=AcceleratorDevice,
    memory=AcceleratorMemory,
    collective=AcceleratorCollective,
    capabilities=capabilities_for,
)
