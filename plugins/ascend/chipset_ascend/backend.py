"""chipset-ascend's backend spec: the only module chipset loads from this plugin.

Importing it imports torch_npu (which registers ``torch.npu`` and the ``npu`` device).
"""

from __future__ import annotations

import os

import torch_npu  # noqa: F401  - registers torch.npu; fails here, in load(), if unusable

from chipset.discovery.spec import BackendSpec
from chipset.errors import ConfigError
from chipset.interfaces import Capabilities
from chipset.interfaces.collective import flight_recorder_file
from chipset_ascend import kernels
from chipset_ascend._runtime import npu
from chipset_ascend.collective import AscendCollective, hccl_timeout_env
from chipset_ascend.device import VISIBLE_ENV, AscendDevice
from chipset_ascend.memory import AscendMemory

HF32_ENV = "CHIPSET_ASCEND_ALLOW_HF32"
# With HF32 on, fp32 matmuls and convolutions run on the cube unit in a reduced
# internal precision (torch_npu documents the switch as the analogue of CUDA's
# allow_tf32). 5e-3 is the tolerance PyTorch's own TF32 tests commonly pass to
# tf32_on_and_off; unverified on hardware.
HF32_FP32_TOLERANCE = (5e-3, 5e-3)

# The fused rms_norm and swiglu operators compute 16-bit inputs in fp32 and round
# once; chipset's reference rounds intermediate products in the 16-bit dtype. The
# two differ by a few units in the last place near zero, so the absolute tolerance
# is a few ulps of the dtype at magnitude 1 (fp16 2^-10, bf16 2^-7). Measured against
# the torch_npu double's fp32 math; to be confirmed on hardware (docs/ascend.md).
FUSED_HALF_TOLERANCES = {
    f"{kernel}/{dtype}": tol
    for kernel in ("rms_norm", "swiglu")
    for dtype, tol in (("float16", (1e-3, 1e-3)), ("bfloat16", (1.6e-2, 8e-3)))
}
# rms_norm's weight gradient is a sum over every row: the fused op accumulates it in fp32
# and rounds once, autograd through the half-precision reference rounds each partial term,
# so single elements differ by a few half-precision steps at the sum's magnitude.
FUSED_HALF_TOLERANCES.update({"rms_norm/float16": (1e-3, 4e-3), "rms_norm/bfloat16": (1.6e-2, 1.6e-2)})


def hf32_allowed() -> bool:
    """HF32 for fp32 matmul/conv: off unless CHIPSET_ASCEND_ALLOW_HF32=1 (see docs/ascend.md)."""
    raw = os.environ.get(HF32_ENV, "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{HF32_ENV} must be 1 or 0, found {raw!r}")


def apply_hf32_policy() -> bool:
    """Set torch.npu.matmul/conv.allow_hf32 to chipset's policy; returns whether HF32 is on.

    torch_npu's defaults differ (matmul False, conv True); chipset sets both so fp32
    means fp32 unless the user opted in, and declares the tolerance to match.
    """
    allow = hf32_allowed()
    npu().matmul.allow_hf32 = allow
    npu().conv.allow_hf32 = allow
    return allow


def visible_device_ids(raw: str) -> list[int]:
    """Parse ASCEND_RT_VISIBLE_DEVICES (comma-separated NPU ids)."""
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{VISIBLE_ENV} must be comma-separated NPU ids (e.g. 0,1,2,3), found {raw!r}") from None


def make_device() -> AscendDevice:
    device = AscendDevice()
    apply_hf32_policy()
    return device


def capabilities(device: AscendDevice) -> Capabilities:
    bf16 = device.bf16_supported()
    half = ("float16", "bfloat16") if bf16 else ("float16",)
    return Capabilities(
        dtypes=("float32", *half, "int8", "int32", "int64", "uint8", "bool"),
        amp_dtypes=tuple(reversed(half)),
        default_dtype="bfloat16" if bf16 else "float32",  # fp16 needs loss scaling: never picked silently
        collective_dtypes=("float32", *half, "int8", "int32", "int64"),
        streams=True,
        event_timing=True,
        graph_capture=False,  # torch_npu has NPU graphs; chipset does not drive them yet
        memory_capacity_enforced=True,
        pinned_memory=True,
        multi_process=True,
        tolerances={**FUSED_HALF_TOLERANCES, **({"float32": HF32_FP32_TOLERANCE} if hf32_allowed() else {})},
    )


def register_kernels(registry, device: AscendDevice) -> None:
    kernels.register(registry, device)


def launch_env(local_rank: int, local_world_size: int) -> dict[str, str]:
    # Every rank sees every visible NPU and binds to its local rank (set_device), as
    # on GPUs; narrowing ASCEND_RT_VISIBLE_DEVICES per rank would break that. What the
    # launcher must carry is HCCL's timeouts, so every rank agrees with chipset's.
    raw = os.environ.get(VISIBLE_ENV)
    if raw is not None:
        ids = visible_device_ids(raw)
        if local_world_size > len(ids):
            raise ConfigError(
                f"{VISIBLE_ENV}={raw!r} makes {len(ids)} NPU(s) visible but {local_world_size} ranks "
                f"per node were asked for; list at least {local_world_size} NPUs or start fewer ranks"
            )
    return {**hccl_timeout_env(), **flight_recorder_env()}


def flight_recorder_env(environ=None) -> dict[str, str]:
    """torch_npu's HCCL flight recorder on, dumping into the run's hang folder on a timeout
    (TORCH_HCCL_* variables, torch_npu's counterparts of NCCL's; any the user set are kept)."""
    environ = os.environ if environ is None else environ
    trace = flight_recorder_file("hccl_trace", environ)
    if trace is None:
        return {}
    wanted = {"TORCH_HCCL_ENABLE_MONITORING": "1", "TORCH_HCCL_TRACE_BUFFER_SIZE": "2000",
              "TORCH_HCCL_DUMP_ON_TIMEOUT": "1", "TORCH_HCCL_DEBUG_INFO_TEMP_FILE": trace}
    return {k: v for k, v in wanted.items() if not environ.get(k)}


spec = BackendSpec(
    name="ascend",
    device=make_device,
    memory=AscendMemory,
    collective=AscendCollective,
    capabilities=capabilities,
    register_kernels=register_kernels,
    launch_env=launch_env,
)
