"""chipset-cuda: the descriptor and a probe that never initialises CUDA (fork-safe)."""

from __future__ import annotations

import os

from chipset.discovery.descriptor import BackendDescriptor

_NVML_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _probe() -> tuple[bool, str]:
    import torch  # already imported by chipset; importing it initialises no device

    if torch.version.cuda is None:
        build = torch.__version__
        return False, f"the installed torch ({build}) is not a CUDA build; install a CUDA build of torch"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False, "CUDA_VISIBLE_DEVICES is set to an empty string: no GPU is visible"
    # Ask NVML, not the CUDA runtime, so no CUDA context is created and fork stays safe.
    raw_nvml = getattr(torch.cuda, "_raw_device_count_nvml", None)
    if raw_nvml is not None:
        n = raw_nvml()
        if n < 0:
            return False, "no NVIDIA driver: NVML could not be loaded or initialised (is the driver installed?)"
        if n == 0:
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
        return False, "torch.cuda reports no usable GPU (driver present but no visible device)"
    return True, f"NVIDIA GPU(s) visible (torch {torch.__version__}, CUDA {torch.version.cuda})"


def _load():
    from chipset_cuda import backend

    return backend


descriptor = BackendDescriptor(
    name="cuda",
    api_version=(1, 0),
    priority=100,
    probe=_probe,
    load=_load,
    description="NVIDIA GPUs through torch.cuda and NCCL.",
    kernels=("scaled_dot_product_attention", "fused_adamw", "rms_norm", "rotary_embedding", "swiglu", "cross_entropy"),
)
