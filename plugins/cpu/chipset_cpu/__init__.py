"""chipset-cpu: the descriptor. Importing this module imports nothing heavy.

The ``cpu`` backend trains on the host for real: plain CPU tensors, torch's own CPU
kernels (SDPA, fused AdamW), gloo collectives, and no simulated capacity or per-op
accounting. It is not a simulator, so automatic selection prefers it to ``cpu_sim``;
its priority (10) keeps it below every accelerator backend (ascend 90, cuda 100).
"""

from __future__ import annotations

import sys

from chipset.discovery.descriptor import BackendDescriptor


def _probe() -> tuple[bool, str]:
    return True, "the host CPU (always available)"


def _device_initialized() -> bool:
    return "chipset_cpu.backend" in sys.modules


def _load():
    from chipset_cpu import backend

    return backend.spec


descriptor = BackendDescriptor(
    name="cpu",
    api_version=(1, 1),
    priority=10,
    device_types=("cpu",),
    probe=_probe,
    load=_load,
    simulator=False,
    kernels=("scaled_dot_product_attention", "fused_adamw", "rms_norm", "swiglu", "cross_entropy"),
    device_initialized=_device_initialized,
    compile_backend="inductor",  # torch's own CPU code generator (needs a C++ compiler)
    description="The host CPU for real: torch CPU kernels (SDPA, fused AdamW), gloo, process memory.",
)
