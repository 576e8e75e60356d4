"""chipset-cuda's backend spec: the only module chipset loads from this plugin.

Loading reads the GPUs' compute capability, which initialises CUDA in this process;
discovery and the probe never do (see ``chipset_cuda.__init__``).
"""

from __future__ import annotations

import os

from chipset.discovery.spec import BackendSpec
from chipset.interfaces import ALL_COLLECTIVES, Capabilities, dtype_name
from chipset.interfaces.collective import flight_recorder_file
from chipset_cuda import ROCM_VISIBLE_ENVS, VISIBLE_ENV
from chipset_cuda import kernels as _kernels
from chipset_cuda.collective import CudaCollective
from chipset_cuda.device import CudaDevice, dtypes_for
from chipset_cuda.memory import CudaMemory

# Flash / memory-efficient attention keep the softmax probabilities in the input dtype
# for the P@V product, where the reference rounds once from fp32; outputs are convex
# combinations of V, so allow two ulps of the dtype at unit scale (docs/cuda.md).
KERNEL_TOLERANCES = {
    "scaled_dot_product_attention/bfloat16": (1.6e-2, 2**-7),
    "scaled_dot_product_attention/float16": (1e-3, 2**-10),
}

# NCCL reduces these; bfloat16 needs NCCL >= 2.10 (every CUDA torch build >= 2.0 ships one).
_NCCL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


def capabilities_for(compute_capability: tuple[int, int], hip_dtypes: tuple | None = None) -> Capabilities:
    """What GPUs of (at least) this compute capability support, as chipset declares it.
    ``hip_dtypes``: the dtypes of an AMD GPU on a ROCm build (then RCCL carries the collectives,
    and HIP graphs, unverified by chipset, are not declared)."""
    dtypes = tuple(dtype_name(d) for d in (hip_dtypes or dtypes_for(compute_capability)))
    bf16 = "bfloat16" in dtypes
    return Capabilities(
        dtypes=dtypes,
        amp_dtypes=("bfloat16", "float16") if bf16 else ("float16",),
        default_dtype="bfloat16" if bf16 else "float32",  # fp16 needs loss scaling: never picked silently
        collectives=ALL_COLLECTIVES,
        collective_dtypes=tuple(d for d in _NCCL_DTYPES if d != "bfloat16" or bf16),
        streams=True,
        event_timing=True,
        graph_capture=hip_dtypes is None,  # CUDA graphs (torch.cuda.graphs), compute capability >= 7.0
        memory_capacity_enforced=True,
        pinned_memory=True,
        multi_process=True,
        tolerances=dict(KERNEL_TOLERANCES),
        # FP8 tensor cores from Ada/Hopper on (chipset_cuda/fp8.py); not declared on ROCm, unverified there.
        fp8=("tensorwise", "rowwise") if hip_dtypes is None and compute_capability >= (8, 9) else (),
    )


def capabilities(device: CudaDevice) -> Capabilities:
    hip = tuple(device.supported_dtypes) if device.hip else None
    return capabilities_for(device.min_compute_capability(), hip)


def register_kernels(registry, device: CudaDevice) -> None:
    _kernels.register(registry, hip=bool(device.hip))


def launch_env(local_rank: int, local_world_size: int) -> dict[str, str]:
    # Every rank sees every GPU the launcher sees and binds to its local rank
    # (device.set_device(local_rank)), as torchrun does. PCI bus order makes CUDA's
    # indices match nvidia-smi's, so CUDA_VISIBLE_DEVICES means the same to both.
    env = {"CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
    for var in (VISIBLE_ENV, *ROCM_VISIBLE_ENVS):  # ROCm's variables are carried too
        if var in os.environ:
            env[var] = os.environ[var]
    return {**env, **flight_recorder_env()}


def flight_recorder_env(environ=None) -> dict[str, str]:
    """NCCL's flight recorder on, dumping into the run's hang folder on a watchdog timeout
    (torch's TORCH_NCCL_* variables; any the user set are kept). Empty without a run directory."""
    environ = os.environ if environ is None else environ
    trace = flight_recorder_file("nccl_trace", environ)
    if trace is None:
        return {}
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace}
    return {k: v for k, v in wanted.items() if not environ.get(k)}


spec = BackendSpec(
    name="cuda",
    device=CudaDevice,
    memory=CudaMemory,
    collective=CudaCollective,
    capabilities=capabilities,
    register_kernels=register_kernels,
    launch_env=launch_env,
)
