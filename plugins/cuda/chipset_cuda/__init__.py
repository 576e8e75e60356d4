"""chipset-cuda: the descriptor and a probe that never initialises CUDA (fork-safe).

Nothing here imports the implementation: ``load()`` imports ``chipset_cuda.backend``,
``profiles`` reads the pure-data datasheet table in ``chipset_cuda.properties``.
"""

from __future__ import annotations

import os

from chipset.discovery.descriptor import BackendDescriptor

_NVML_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"

KERNELS = ("scaled_dot_product_attention", "fused_adamw", "rms_norm", "rotary_embedding", "swiglu", "cross_entropy")


def _probe(torch_module=None) -> tuple[bool, str]:
    """(available, reason). ``torch_module`` is for tests (a named double of torch)."""
    if torch_module is None:
        import torch as torch_module  # already imported by chipset; initialises no device
    torch = torch_module
    if torch.version.cuda is None:
        return False, f"the installed torch ({torch.__version__}) is not a CUDA build; install a CUDA build of torch"
    visible = os.environ.get(VISIBLE_ENV)
    if visible is not None and visible.strip() == "":
        return False, f"{VISIBLE_ENV} is set to an empty string: no GPU is visible"
    # Ask NVML, not the CUDA runtime, so no CUDA context is created and fork stays safe.
    raw_nvml = getattr(torch.cuda, "_raw_device_count_nvml", None)
    present = None
    if raw_nvml is not None:
        try:
            present = raw_nvml()
        except OSError:  # torch 2.8 raises where libnvidia-ml.so is absent; 2.13 returns -1
            present = -1
        if present < 0:
            return False, "no NVIDIA driver: NVML could not be loaded or initialised (is the driver installed?)"
        if present == 0:
            return False, "the NVIDIA driver reports zero GPUs"
    old = os.environ.get(_NVML_ENV)
    os.environ[_NVML_ENV] = "1"
    try:
        available = torch.cuda.is_available()
    finally:
        if old is None:
            os.environ.pop(_NVML_ENV, None)
        else:
            os.environ[_NVML_ENV] = old
    if not available:
        if present and visible is not None:
            return False, f"{present} GPU(s) present but {VISIBLE_ENV}={visible!r} leaves none visible"
        return False, "torch.cuda reports no usable GPU (driver present but no visible device)"
    where = f", {VISIBLE_ENV}={visible}" if visible is not None else ""
    return True, f"NVIDIA GPU(s) visible (torch {torch.__version__}, CUDA {torch.version.cuda}{where})"


def _load():
    from chipset_cuda import backend

    return backend


def _profiles():
    from chipset_cuda.properties import profiles

    return profiles()


descriptor = BackendDescriptor(
    name="cuda",
    api_version=(1, 0),
    priority=100,
    probe=_probe,
    load=_load,
    description="NVIDIA GPUs through torch.cuda and NCCL.",
    kernels=KERNELS,
    profiles=_profiles,
    compile_backend="inductor",
)
