"""Datasheet profiles of accelerators served by the generic backend (Intel Data Center GPU
Max), and what any other device of a torch device module reports about itself.

Pure data plus one reader: importing this module touches no device, so the descriptor
exposes the table as named profiles (``max-1550``, ``max-1100``) on any machine.

Conventions as in chipset-cuda's table: ``peak_flops`` are dense rates per dtype name,
memory bandwidth in bytes/s (decimal), intra-node bandwidth per direction. Sources:

  [Max]  Intel Data Center GPU Max Series product brief and the product pages on
         intel.com/ark (2023): Max 1550: 128 Xe cores, 1.6 GHz max, 128 GB HBM2e at
         3.2768 TB/s, FP64/FP32 vector 52.4 TFLOP/s, TF32 XMX 419.4, BF16/FP16 XMX
         838.9 TFLOP/s. Max 1100: 56 Xe cores, 1.55 GHz, 48 GB HBM2e at 1.2288 TB/s,
         FP64/FP32 22.2, TF32 177.7, BF16/FP16 355.3 TFLOP/s. Both are consistent with
         256 FP32 and 4,096 BF16 FLOP per clock per Xe core (1550: 128 x 1.6e9 x 4096 =
         838.9e12), the derivation used for the 1100's matrix rates.
  Links: Xe Link bridges are optional; the intra-node figure is the PCIe Gen5 x16 link
         (~64 GB/s per direction), a conservative estimate, and inter-node one 200 Gb/s
         NIC per GPU, an estimate of typical Aurora-class systems. Latencies: estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from chipset.interfaces.device import DeviceProperties

GiB = 2**30
T = 1e12
GBps = 1e9

_PCIE5 = 64 * GBps
_NIC_200G = 200e9 / 8
_LINK_LATENCY = 5e-6
_NETWORK_LATENCY = 10e-6


@dataclass(frozen=True)
class AcceleratorSpec:
    key: str
    name: str
    match: str
    """Upper-case text the runtime's device name contains, e.g. ``"MAX 1550"``."""
    memory: int
    fp64: float
    fp32: float
    tf32: float
    bf16: float
    memory_bandwidth: float
    multiprocessors: int
    source: str

    def to_properties(self, index: int = 0) -> DeviceProperties:
        return DeviceProperties(
            name=self.name, index=index, total_memory=self.memory,
            peak_flops={"float64": self.fp64, "float32": self.fp32, "tf32": self.tf32,
                        "bfloat16": self.bf16, "float16": self.bf16},
            memory_bandwidth=self.memory_bandwidth, intra_node_bandwidth=_PCIE5,
            inter_node_bandwidth=_NIC_200G, intra_node_latency=_LINK_LATENCY,
            inter_node_latency=_NETWORK_LATENCY, multiprocessor_count=self.multiprocessors,
            estimated=False, source=self.source,
        )


_MAX = "Intel Data Center GPU Max Series product brief / intel.com ark (2023), dense XMX rates"

SPECS: dict[str, AcceleratorSpec] = {
    s.key: s
    for s in (
        AcceleratorSpec("max-1550", "Intel(R) Data Center GPU Max 1550", "MAX 1550", 128 * GiB,
                        52.4 * T, 52.4 * T, 419.4 * T, 838.9 * T, 3276.8 * GBps, 128, _MAX),
        AcceleratorSpec("max-1100", "Intel(R) Data Center GPU Max 1100", "MAX 1100", 48 * GiB,
                        22.2 * T, 22.2 * T, 177.7 * T, 355.3 * T, 1228.8 * GBps, 56, _MAX),
    )
}


def profiles() -> dict[str, DeviceProperties]:
    """Every table row as a named profile (for ``BackendDescriptor.profiles``)."""
    return {key: spec.to_properties() for key, spec in SPECS.items()}


def lookup(device_name: str) -> AcceleratorSpec | None:
    n = device_name.upper()
    return next((s for s in SPECS.values() if s.match in n), None)


def describe(device_type: str, module, torch_index: int, index: int | None = None) -> DeviceProperties:
    """What ``torch.<device_type>`` reports about device ``index``: the table's rates for a
    known part; for any other part its name and memory, no rates, labelled estimated."""
    index = torch_index if index is None else index
    props = module.get_device_properties(torch_index)
    name = str(getattr(props, "name", "") or f"{device_type}:{index}")
    total = int(props.total_memory)
    units = getattr(props, "gpu_subslice_count", None) or getattr(props, "multi_processor_count", None)
    asked = f"torch.{device_type}.get_device_properties({torch_index})"
    spec = lookup(name)
    if spec is None:
        return DeviceProperties(name=name, index=index, total_memory=total, multiprocessor_count=units,
                                estimated=True, source=f"{asked}; no chipset profile for {name!r}: no peak rates")
    known = spec.to_properties(index)
    return DeviceProperties(**{**known.to_dict(), "name": name, "total_memory": total,
                               "peak_flops": known.peak_flops,
                               "source": f"memory: {asked}; rates: {spec.source} (row {spec.key!r})"})
