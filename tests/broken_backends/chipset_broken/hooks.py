"""The broken backends' implementations: cpu_sim's classes with one defect each."""

from __future__ import annotations

from chipset.discovery.hookspecs import hookimpl
from chipset.interfaces import ALL_COLLECTIVES, Capabilities, MemoryStats
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import SimDevice, SimEvent
from chipset_cpu_sim.memory import SimMemory


def initialise_device(variant: str) -> None:
    SimDevice()  # creating the device is this backend's "device init"


class _NegativeEvent(SimEvent):
    def elapsed_time(self, end) -> float:
        return -abs(super().elapsed_time(end)) - 1.0


class _Device(SimDevice):
    def __init__(self, variant: str):
        super().__init__()
        self.backend_name = variant
        self.variant = variant

    def event(self, enable_timing: bool = False):
        if self.variant == "bad_event":
            return _NegativeEvent(enable_timing)
        return super().event(enable_timing)

    @property
    def supported_dtypes(self):
        if self.variant == "few_caps":
            import torch

            return (torch.float32,)
        return super().supported_dtypes


class _UnderCountingMemory(SimMemory):
    def stats(self, index=None) -> MemoryStats:
        s = super().stats(index)
        return MemoryStats(s.allocated // 2, s.reserved, s.active, s.peak_allocated // 2, s.peak_reserved, s.peak_active)


class _DroppingCollective(SimCollective):
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        g = group or self.world
        if self.rank() == g.ranks[-1]:
            tensor.zero_()  # this rank's contribution never makes it into the sum
        return super().all_reduce(tensor, op, group, async_op)


class Plugin:
    """pluggy plugin object for one variant."""

    def __init__(self, variant: str):
        self.variant = variant

    @hookimpl
    def chipset_device(self):
        return _Device(self.variant)

    @hookimpl
    def chipset_memory(self, device):
        return (_UnderCountingMemory if self.variant == "bad_memory" else SimMemory)(device)

    @hookimpl
    def chipset_collective(self, device):
        c = (_DroppingCollective if self.variant == "bad_allreduce" else SimCollective)(device)
        c.backend_name = self.variant
        return c

    @hookimpl
    def chipset_capabilities(self, device):
        if self.variant == "few_caps":
            return Capabilities(
                dtypes=("float32",), amp_dtypes=(), collectives=("all_reduce", "barrier"),
                collective_dtypes=("float32",), streams=False, event_timing=False,
                memory_capacity_enforced=False, multi_process=True,
            )
        return Capabilities(
            dtypes=("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"),
            amp_dtypes=("bfloat16", "float16"), collectives=ALL_COLLECTIVES,
            collective_dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
            streams=True, event_timing=True, memory_capacity_enforced=True, multi_process=True,
        )

    @hookimpl
    def chipset_register_kernels(self, registry, device):
        if self.variant != "bad_kernel":
            return
        import torch

        ref = registry.reference("swiglu")

        def swiglu(gate, up):
            out = ref(gate, up)
            return out * (1 + 1e-3) if out.dtype == torch.float32 else out

        registry.register("swiglu", swiglu, priority=5, description="swiglu, off by 1e-3 in float32")
