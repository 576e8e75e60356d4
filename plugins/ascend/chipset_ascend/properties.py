"""Ascend 910B device profiles: pure data, readable on any machine (no torch_npu, no NPU).

Huawei publishes no per-SKU datasheet for the 910B1..B4 chips, so every rate here is
labelled with where it comes from. ``estimated=True`` means at least one rate is not
a number we could tie to a public primary source; docs/ascend.md has the table with
each source and the reasoning behind each estimate. Capacities are the HBM size;
what torch_npu reports as ``total_memory`` on hardware is lower (the runtime reserves
some: OOM messages from 64 GB parts read "60.96 GiB total capacity").

Units: bytes, FLOP/s and bytes/s (per direction), like :class:`chipset.DeviceProperties`.
"""

from __future__ import annotations

from collections.abc import Mapping

from chipset.interfaces.device import DeviceProperties

__all__ = ["PROFILES", "profiles", "profile_for_soc_name", "normalise_soc_name"]

GiB = 2**30
TFLOPS = 1e12
GBps = 1e9

# Interconnect of an Atlas 800T A2 node, shared by the 64 GB variants (estimates,
# see docs/ascend.md): HCCS full mesh between the 8 NPUs, 7 links per NPU at a
# reported 56 GB/s each (392 GB/s aggregate, counted both directions) -> 196 GB/s per
# direction; one 200GE RoCE port per NPU to other nodes -> 25 GB/s per direction.
_HCCS_PER_DIRECTION = 196 * GBps
_ROCE_PER_DIRECTION = 25 * GBps
_HCCS_LATENCY = 5e-6  # estimate, same order as NVLink-class fabrics
_ROCE_LATENCY = 10e-6  # estimate, RDMA over 200GE

_SOURCE = "see docs/ascend.md#properties (third-party reports; labelled estimates)"


def _p(name: str, hbm_gib: int, fp16_tflops: float, hbm_tbps: float, source: str, estimated: bool = True) -> DeviceProperties:
    # The cube unit runs fp16 and bf16 at the same rate on 910B (both are 16-bit MACs);
    # fp32 on the cube is not a published figure, so it is left out (0.0 = unknown).
    return DeviceProperties(
        name=name,
        index=0,
        total_memory=hbm_gib * GiB,  # HBM stacks come in binary sizes
        peak_flops={"float16": fp16_tflops * TFLOPS, "bfloat16": fp16_tflops * TFLOPS},
        memory_bandwidth=hbm_tbps * 1000 * GBps,
        intra_node_bandwidth=_HCCS_PER_DIRECTION,
        inter_node_bandwidth=_ROCE_PER_DIRECTION,
        intra_node_latency=_HCCS_LATENCY,
        inter_node_latency=_ROCE_LATENCY,
        estimated=estimated,
        source=source,
    )


PROFILES: dict[str, DeviceProperties] = {
    # The generic profile uses the one FP16 figure we found in an operator's own
    # documentation (Gitee AI compute docs: 910B, 64 GB HBM2e, FP16 280 TFLOPS); HBM
    # bandwidth is an estimate. Use it when the exact SKU is unknown: it is the
    # conservative end of the reported range.
    "910b": _p("Ascend910B", 64, 280, 1.6, "910B generic: FP16 280 TFLOPS and 64 GB HBM2e from Gitee AI compute docs; bandwidths estimated; " + _SOURCE),
    "910b1": _p("Ascend910B1", 64, 414, 1.6, "910B1: estimate; " + _SOURCE),
    "910b2": _p("Ascend910B2", 64, 376, 1.6, "910B2: estimate; " + _SOURCE),
    "910b3": _p("Ascend910B3", 64, 313, 1.6, "910B3: estimate; " + _SOURCE),
    "910b4": _p("Ascend910B4", 32, 280, 0.8, "910B4: estimate; " + _SOURCE),
}


def profiles() -> Mapping[str, DeviceProperties]:
    """The named Ascend profiles (the descriptor's ``profiles`` callable)."""
    return dict(PROFILES)


def normalise_soc_name(name: str) -> str:
    """``"Ascend910B3"`` / ``"ascend 910B3"`` -> ``"910b3"``."""
    n = name.strip().lower().replace(" ", "").replace("-", "").replace("_", "")
    return n.removeprefix("ascend")


def profile_for_soc_name(name: str) -> DeviceProperties | None:
    """The profile matching a SoC name reported by torch_npu, or None if it is not a 910B variant we know.

    Packaging suffixes (``"Ascend910B2C"``, ``"Ascend910B4-1"``) fall back to the longest
    known profile name they start with.
    """
    n = normalise_soc_name(name)
    for key in sorted(PROFILES, key=len, reverse=True):
        if n == key or (n.startswith(key) and key != "910b"):
            return PROFILES[key]
    return PROFILES["910b"] if n.startswith("910b") else None
