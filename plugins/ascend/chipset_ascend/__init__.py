"""chipset-ascend: the descriptor and a probe that never imports torch_npu or touches a device."""

from __future__ import annotations

import glob
import importlib.util
import os

from chipset.discovery.descriptor import BackendDescriptor


def _probe() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (pip install torch-npu matching your torch and CANN)"
    if not os.environ.get("ASCEND_HOME_PATH"):
        return False, "the CANN environment is not set (ASCEND_HOME_PATH is empty); source CANN's set_env.sh"
    import torch

    if torch.version.cuda is not None:
        return False, (
            f"the installed torch ({torch.__version__}) is a CUDA build; torch_npu refuses to load beside it "
            "(install the CPU build of torch that matches torch_npu)"
        )
    if os.environ.get("ASCEND_RT_VISIBLE_DEVICES", None) == "":
        return False, "ASCEND_RT_VISIBLE_DEVICES is set to an empty string: no NPU is visible"
    if not glob.glob("/dev/davinci[0-9]*"):
        return False, "no Ascend NPU device files (/dev/davinci*) found: zero devices or driver not loaded"
    return True, "Ascend NPU(s) present with torch_npu and CANN"


def _load():
    from chipset_ascend import backend

    return backend


descriptor = BackendDescriptor(
    name="ascend",
    api_version=(1, 0),
    priority=90,
    probe=_probe,
    load=_load,
    description="Huawei Ascend NPUs through torch_npu and HCCL.",
    kernels=("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "swiglu", "fused_adamw"),
)
