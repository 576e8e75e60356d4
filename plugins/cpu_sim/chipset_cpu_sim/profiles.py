"""Simulated device profiles (CHIPSET_SIM_PROFILE). Rates are per second, sizes in bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30
TFLOPS = 1e12
GBps = 1e9


@dataclass(frozen=True)
class SimProfile:
    name: str
    memory: int
    peak_flops: dict[str, float] = field(default_factory=dict)
    memory_bandwidth: float = 0.0
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_latency: float = 0.0
    description: str = ""


PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        SimProfile(
            "sim-generic",
            memory=16 * GiB,
            peak_flops={"float32": 20 * TFLOPS, "bfloat16": 100 * TFLOPS, "float16": 100 * TFLOPS},
            memory_bandwidth=1000 * GBps,
            intra_node_bandwidth=100 * GBps,
            inter_node_bandwidth=25 * GBps,
            intra_node_latency=5e-6,
            inter_node_latency=10e-6,
            description="A generic mid-range accelerator: the default.",
        ),
        SimProfile(
            "sim-small",
            memory=256 * 2**20,
            peak_flops={"float32": 1 * TFLOPS, "bfloat16": 4 * TFLOPS, "float16": 4 * TFLOPS},
            memory_bandwidth=100 * GBps,
            intra_node_bandwidth=10 * GBps,
            inter_node_bandwidth=2.5 * GBps,
            intra_node_latency=10e-6,
            inter_node_latency=20e-6,
            description="A 256 MiB device, to exercise out-of-memory paths with tiny models.",
        ),
    )
}

DEFAULT_PROFILE = "sim-generic"
