"""chipset-accelerator: whatever accelerator the installed torch reports, through torch's
common device surface only (``torch.accelerator``, ``torch.get_device_module`` and
``torch.distributed.get_default_backend_for_device``).

It serves Intel XPU (in-tree, ``xccl``), vendors' PrivateUse1 devices (a renamed device
type with a ``torch.<name>`` module) and Apple MPS (one process: torch has no MPS
collective). Vendor plugins (chipset-cuda, chipset-ascend) build their devices on its
classes and keep only their real differences. The probe initialises no device: it reads
which accelerator this torch build has and asks that device module ``is_available()``.
"""

from __future__ import annotations

import os

from chipset.discovery.descriptor import BackendDescriptor

_NVML_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
SINGLE_PROCESS_TYPES = ("mps",)
"""Device types torch maps to a distributed backend that cannot carry their tensors (MPS -> gloo)."""


def accelerator_type(torch_module=None) -> str | None:
    """The accelerator device type of this torch build (``"xpu"``, ``"cuda"``, a renamed
    PrivateUse1 type, ...), or None for a CPU-only build. Initialises no device."""
    if torch_module is None:
        import torch as torch_module
    acc = torch_module.accelerator.current_accelerator()
    return None if acc is None else acc.type


def distributed_backend(device_type: str, torch_module=None) -> str | None:
    """The c10d backend torch uses for ``device_type`` (``nccl``, ``xccl``, a vendor's), or None
    when torch has none that can carry its tensors (then only one process can run)."""
    if device_type in SINGLE_PROCESS_TYPES:
        return None
    if torch_module is None:
        import torch as torch_module
    dist = torch_module.distributed
    if not dist.is_available():
        return None
    try:
        return dist.get_default_backend_for_device(device_type)
    except ValueError:
        return None


def _probe(torch_module=None) -> tuple[bool, str]:
    """(available, reason). ``torch_module`` is for tests (a named double of torch)."""
    if torch_module is None:
        import torch as torch_module
    torch = torch_module
    kind = accelerator_type(torch)
    if kind is None:
        return False, (f"no accelerator in this torch build (torch {torch.__version__} reports none through "
                       "torch.accelerator): install the torch build or vendor package for your device")
    try:
        module = torch.get_device_module(kind)
    except RuntimeError:
        return False, f"torch reports accelerator {kind!r} but no torch.{kind} module is registered (is the vendor package imported?)"
    old = os.environ.get(_NVML_ENV)
    os.environ[_NVML_ENV] = "1"  # CUDA/ROCm: answer from NVML/amdsmi, create no context (fork-safe)
    try:
        available = bool(module.is_available())
    finally:
        if old is None:
            os.environ.pop(_NVML_ENV, None)
        else:
            os.environ[_NVML_ENV] = old
    if not available:
        return False, (f"torch reports a {kind} accelerator but torch.{kind}.is_available() is False: "
                       "no device is visible (driver not loaded, or hidden by the visible-devices variable)")
    c10d = distributed_backend(kind, torch)
    where = f"collectives through {c10d!r}" if c10d else "one process only (torch has no collective backend for it)"
    return True, f"{kind} device(s) available through torch.accelerator (torch {torch.__version__}; {where})"


def _load():
    from chipset_accelerator import backend

    return backend.spec


def _profiles():
    from chipset_accelerator.properties import profiles

    return profiles()


descriptor = BackendDescriptor(
    name="accelerator",
    api_version=(1, 1),
    priority=30,  # below the vendor plugins (ascend 90, cuda 100), above the host (cpu 10)
    device_types=("*",),  # whatever accelerator torch reports
    probe=_probe,
    load=_load,
    description="Any accelerator torch reports (XPU, PrivateUse1 devices, MPS) through torch.accelerator.",
    profiles=_profiles,
    compile_backend=None,  # inductor support differs by device type; not verified here
)
