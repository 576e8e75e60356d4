"""TEST DOUBLE of torch_npu for chipset's tests. Never shipped; see ../README.md.

Implements, over CPU tensors, the documented torch_npu API surface chipset-ascend
uses, with strict argument checks on the fused operators.
"""

from __future__ import annotations

import os

import torch

if torch.version.cuda is not None:  # what the real package refuses
    raise RuntimeError(
        "Two accelerators cannot be used at the same time in PyTorch: torch_npu cannot be "
        f"imported with a CUDA build of torch ({torch.__version__})"
    )
if not os.environ.get("ASCEND_HOME_PATH"):
    # The real package fails loading CANN's shared libraries when set_env.sh was not sourced.
    raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")

from torch_npu import _double, npu, optim  # noqa: E402
from torch_npu._ops import (  # noqa: E402
    npu_fusion_attention,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
)

__version__ = "0.0.0+chipset.test.double"
IS_CHIPSET_TEST_DOUBLE = True

torch.npu = npu  # torch_npu makes itself reachable as torch.npu
_double.register_hccl()

if os.environ.get("TORCH_NPU_DOUBLE_PLACE_ON_HOST") == "1":
    # Opt-in for whole-suite runs in a subprocess: the plugin's tensors go to the host,
    # since stock torch has no "npu" kernels. In-process tests set this per device instead.
    import chipset_ascend.device

    chipset_ascend.device.AscendDevice.device_type = "cpu"

__all__ = ["npu", "optim", "npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]
