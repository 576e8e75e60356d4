"""Capabilities: a machine-readable declaration of what a backend supports.

Tests and the engine branch on these, never on backend names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

__all__ = ["Capabilities", "ALL_COLLECTIVES"]

ALL_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send_recv",
    "batch_p2p",
    "barrier",
)


@dataclass(frozen=True)
class Capabilities:
    """What one backend declares it supports."""

    dtypes: tuple[str, ...] = ("float32",)
    """Dtype names tensors may have on the device."""
    amp_dtypes: tuple[str, ...] = ()
    """Dtype names usable as autocast compute dtypes."""
    default_dtype: str = "float32"
    """The compute dtype ``train.dtype = "auto"`` picks: the one this device trains fastest in
    (bfloat16 on GPUs and NPUs with bf16 units; float32 on CPUs, where bf16 matmuls are emulated
    and about 6x slower). One of ``dtypes``."""
    collectives: tuple[str, ...] = ALL_COLLECTIVES
    """Collective ops (names from ALL_COLLECTIVES) that work."""
    collective_dtypes: tuple[str, ...] = ("float32",)
    """Dtypes collectives accept."""
    streams: bool = False
    """Multiple streams with ordering semantics."""
    event_timing: bool = False
    """Events with ``enable_timing=True`` and ``elapsed_time``."""
    graph_capture: bool = False
    """Capture and replay of device work graphs."""
    memory_capacity_enforced: bool = True
    """Allocating past the device capacity raises OutOfMemoryError."""
    memory_accounting: str = "exact"
    """How ``Memory.stats`` counts: ``"exact"`` (every tensor's bytes, up to allocator rounding)
    or ``"process"`` (the process's resident memory, for a host backend that keeps no
    per-tensor count; the conformance suite then skips the per-tensor checks)."""
    pinned_memory: bool = False
    """Page-locked host memory is available."""
    multi_process: bool = True
    """Several processes (ranks) can run collectives together."""
    ranks_share_device: bool = False
    """Several ranks may bind to the same device (true for simulators; NCCL/HCCL refuse it)."""
    kernels: tuple[str, ...] = ()
    """Kernels this backend registers its own implementation for."""
    fp8: tuple[str, ...] = ()
    """FP8 GEMM scalings (``"tensorwise"``, ``"rowwise"``) this backend's ``fp8_matmul`` kernel runs
    with the reference's numerics (kernels/fp8.py), certified by the conformance suite; ``train.fp8``
    is refused where the scaling it names is not declared. Empty: no FP8 training."""
    tolerances: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Per-dtype (rtol, atol) overrides against the reference, with the reason in docs."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tolerances"] = {k: list(v) for k, v in self.tolerances.items()}
        return d

    def has_dtype(self, name: str) -> bool:
        return name in self.dtypes

    def has_collective(self, name: str) -> bool:
        return name in self.collectives
