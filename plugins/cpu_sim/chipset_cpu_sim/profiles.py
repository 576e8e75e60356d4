"""Simulated device profiles (CHIPSET_SIM_PROFILE). Rates are per second, sizes in bytes.

The simulator's own profiles are listed here. ``CHIPSET_SIM_PROFILE`` may also name any
profile another installed backend declares through ``BackendDescriptor.profiles`` (for
example ``"h100-sxm"``), so a model can be sized against real hardware on a laptop.
This module imports nothing heavy: the descriptor exposes it to the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30
MiB = 2**20
TFLOPS = 1e12
GBps = 1e9


@dataclass(frozen=True)
class SimProfile:
    """One simulated device model. Every rate is labelled an estimate."""

    name: str
    memory: int
    """Capacity in bytes; allocating past it raises chipset.OutOfMemoryError."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype name."""
    memory_bandwidth: float = 0.0
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_latency: float = 0.0
    description: str = ""
    source: str = ""
    """Where the numbers come from (a sim profile, or the backend that declared it)."""


def _rates(fp32: float, half: float) -> dict[str, float]:
    return {"float32": fp32 * TFLOPS, "bfloat16": half * TFLOPS, "float16": half * TFLOPS}


PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        SimProfile(
            "sim-generic", memory=16 * GiB, peak_flops=_rates(20, 100),
            memory_bandwidth=1000 * GBps, intra_node_bandwidth=100 * GBps, inter_node_bandwidth=25 * GBps,
            intra_node_latency=5e-6, inter_node_latency=10e-6,
            description="A generic mid-range accelerator: the default.",
        ),
        SimProfile(
            "sim-small", memory=256 * MiB, peak_flops=_rates(1, 4),
            memory_bandwidth=100 * GBps, intra_node_bandwidth=10 * GBps, inter_node_bandwidth=2.5 * GBps,
            intra_node_latency=10e-6, inter_node_latency=20e-6,
            description="A 256 MiB device, to exercise out-of-memory paths with tiny models.",
        ),
        SimProfile(
            "sim-tiny", memory=16 * MiB, peak_flops=_rates(0.1, 0.4),
            memory_bandwidth=10 * GBps, intra_node_bandwidth=1 * GBps, inter_node_bandwidth=0.25 * GBps,
            intra_node_latency=20e-6, inter_node_latency=50e-6,
            description="A 16 MiB device: OOM within a few tensors, for unit tests.",
        ),
        SimProfile(
            "sim-large", memory=80 * GiB, peak_flops=_rates(60, 900),
            memory_bandwidth=3000 * GBps, intra_node_bandwidth=400 * GBps, inter_node_bandwidth=50 * GBps,
            intra_node_latency=3e-6, inter_node_latency=8e-6,
            description="A large training accelerator (80 GiB, ~900 TFLOP/s bf16 class).",
        ),
        SimProfile(
            "sim-multinode", memory=64 * GiB, peak_flops=_rates(40, 300),
            memory_bandwidth=1600 * GBps, intra_node_bandwidth=200 * GBps, inter_node_bandwidth=12.5 * GBps,
            intra_node_latency=4e-6, inter_node_latency=25e-6,
            description="A 64 GiB device on a slow (100 Gb/s) inter-node network: for planner what-ifs.",
        ),
    )
}

DEFAULT_PROFILE = "sim-generic"


def descriptor_profiles():
    """The simulator's profiles as ``{name: chipset.DeviceProperties}`` (for BackendDescriptor.profiles)."""
    from chipset.interfaces.device import DeviceProperties

    return {
        p.name: DeviceProperties(
            name=p.name, index=0, total_memory=p.memory, peak_flops=dict(p.peak_flops),
            memory_bandwidth=p.memory_bandwidth, intra_node_bandwidth=p.intra_node_bandwidth,
            inter_node_bandwidth=p.inter_node_bandwidth, intra_node_latency=p.intra_node_latency,
            inter_node_latency=p.inter_node_latency, estimated=True, source=f"cpu_sim profile {p.name!r}",
        )
        for p in PROFILES.values()
    }


def from_properties(name: str, backend: str, props) -> SimProfile:
    """A SimProfile that mirrors a DeviceProperties another backend declared."""
    return SimProfile(
        name=name, memory=int(props.total_memory), peak_flops=dict(props.peak_flops),
        memory_bandwidth=props.memory_bandwidth, intra_node_bandwidth=props.intra_node_bandwidth,
        inter_node_bandwidth=props.inter_node_bandwidth, intra_node_latency=props.intra_node_latency,
        inter_node_latency=props.inter_node_latency,
        description=f"{props.name}, simulated", source=f"profile {name!r} declared by backend {backend!r}",
    )


def resolve(name: str) -> SimProfile:
    """The profile called ``name``: the simulator's own first, then any installed backend's.

    Raises ConfigError listing every known name.
    """
    if name in PROFILES:
        return PROFILES[name]
    from chipset.discovery.profiles import all_profiles
    from chipset.errors import ConfigError

    others = {k: v for k, v in all_profiles().items() if k not in PROFILES}
    if name in others:
        backend, props = others[name]
        return from_properties(name, backend, props)
    known = ", ".join(sorted(PROFILES)) + (f"; from other backends: {', '.join(sorted(others))}" if others else "")
    raise ConfigError(
        f"CHIPSET_SIM_PROFILE={name!r} is not a known device profile. Known profiles: {known}. "
        "Unset it for the default (sim-generic) or pick one of those."
    )
