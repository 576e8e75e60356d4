"""chipset-cuda: the descriptor and a probe that never initialises CUDA (fork-safe).

It serves NVIDIA GPUs (CUDA builds of torch) and AMD GPUs (ROCm builds: ``torch.version.hip``
is set, torch.cuda runs on HIP and the ``nccl`` process-group name is RCCL).

Nothing here imports the implementation: ``load()`` imports ``chipset_cuda.backend``,
``profiles`` reads the pure-data datasheet table in ``chipset_cuda.properties``.
"""

from __future__ import annotations

import os

from chipset.discovery.descriptor import BackendDescriptor

_NVML_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ROCM_VISIBLE_ENVS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", VISIBLE_ENV)
"""What narrows the GPUs a ROCm process sees (ROCr's, then HIP's, then the CUDA name HIP honours)."""

KERNELS = ("scaled_dot_product_attention", "fused_adamw", "rms_norm", "rotary_embedding", "swiglu", "cross_entropy",
           "fp8_matmul")


def _probe(torch_module=None) -> tuple[bool, str]:
    """(available, reason). ``torch_module`` is for tests (a named double of torch)."""
    if torch_module is None:
        import torch as torch_module  # already imported by chipset; initialises no device
    torch = torch_module
    hip = getattr(torch.version, "hip", None)
    if hip:
        return _probe_rocm(torch, hip)
    if torch.version.cuda is None:
        return False, (f"the installed torch ({torch.__version__}) is not a CUDA build; install a CUDA build of "
                       "torch for NVIDIA GPUs, or a ROCm build for AMD GPUs")
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


def _probe_rocm(torch, hip: str) -> tuple[bool, str]:
    """The probe on a ROCm build: amdsmi's device count (no HIP context), then torch.cuda."""
    for var in ROCM_VISIBLE_ENVS:
        raw = os.environ.get(var)
        if raw is not None and raw.strip() == "":
            return False, f"{var} is set to an empty string: no AMD GPU is visible"
    raw_amdsmi = getattr(torch.cuda, "_raw_device_count_amdsmi", None)
    present = None
    if raw_amdsmi is not None:
        try:
            present = raw_amdsmi()
        except OSError:
            present = -1
        if present < 0:
            return False, ("no AMD GPU driver: amdsmi could not be loaded or initialised "
                           "(is the amdgpu kernel driver loaded and ROCm installed? check rocm-smi)")
        if present == 0:
            return False, "the AMD GPU driver (amdgpu) reports zero GPUs"
    old = os.environ.get(_NVML_ENV)
    os.environ[_NVML_ENV] = "1"  # on ROCm torch reads it too and counts through amdsmi
    try:
        available = torch.cuda.is_available()
    finally:
        if old is None:
            os.environ.pop(_NVML_ENV, None)
        else:
            os.environ[_NVML_ENV] = old
    if not available:
        shown = {v: os.environ[v] for v in ROCM_VISIBLE_ENVS if v in os.environ}
        hint = f"{present} AMD GPU(s) present but {shown} leaves none visible" if present and shown else (
            "torch.cuda (HIP) reports no usable AMD GPU (driver present but no visible device)")
        return False, hint
    return True, (f"AMD GPU(s) visible through ROCm (torch {torch.__version__}, HIP {hip}, amdgpu driver; "
                  "collectives through RCCL as 'nccl')")


def _load():
    from chipset_cuda import backend

    return backend.spec


def _profiles():
    from chipset_cuda.properties import profiles

    return profiles()


descriptor = BackendDescriptor(
    name="cuda",
    api_version=(1, 1),
    priority=100,
    device_types=("cuda",),  # CUDA and ROCm builds alike
    probe=_probe,
    load=_load,
    description="NVIDIA GPUs (torch.cuda, NCCL) and AMD GPUs (ROCm builds: torch.cuda on HIP, RCCL).",
    kernels=KERNELS,
    profiles=_profiles,
    compile_backend="inductor",
)
