"""chipset-ascend: the descriptor and a probe that never imports torch_npu or touches a device.

The probe only looks: is the torch_npu distribution importable (without importing
it), is the installed torch a build torch_npu can live beside, is the CANN
environment sourced, and are there NPU device files. Importing torch_npu would load
CANN and may initialise the NPU runtime, which makes a later fork unsafe, so that
waits for ``load()``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from chipset.discovery.descriptor import BackendDescriptor

DEVICE_FILES_GLOB = "/dev/davinci[0-9]*"
"""The Ascend driver creates one /dev/davinciN per NPU (plus davinci_manager, not counted)."""


def _probe() -> tuple[bool, str]:
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, "torch_npu is not installed (pip install torch-npu matching your torch and CANN versions)"
    import torch  # chipset has imported it already; importing torch initialises no device

    if torch.version.cuda is not None:
        return False, (
            f"the installed torch ({torch.__version__}) is a CUDA build; torch_npu refuses to load beside it "
            "(\"Two accelerators cannot be used at the same time\"): install the CPU build of torch that matches torch_npu"
        )
    home = os.environ.get("ASCEND_HOME_PATH", "")
    if not home:
        return False, (
            "the CANN environment is not set (ASCEND_HOME_PATH is empty): "
            "source <CANN install>/set_env.sh, e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh"
        )
    if not os.path.isdir(home):
        return False, f"ASCEND_HOME_PATH={home!r} is not a directory: CANN is not installed there; source the right set_env.sh"
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if not ids:
            return False, "ASCEND_RT_VISIBLE_DEVICES is set to an empty string: no NPU is visible; unset it or list NPU ids"
        if not all(x.isdigit() for x in ids):
            return False, f"ASCEND_RT_VISIBLE_DEVICES={visible!r} must be comma-separated NPU ids (e.g. 0,1,2,3)"
    devices = sorted(glob.glob(DEVICE_FILES_GLOB))
    if not devices:
        return False, (
            f"zero NPUs: no Ascend device files ({DEVICE_FILES_GLOB}) found; the driver is not loaded "
            "or, in a container, the NPUs were not passed through"
        )
    shown = f", {len(ids)} visible via ASCEND_RT_VISIBLE_DEVICES" if visible is not None else ""
    return True, f"{len(devices)} Ascend NPU(s) present{shown}, with torch_npu and CANN ({home})"


def _device_initialized() -> bool:
    # Reads the state of an already-imported torch_npu; never imports or initialises it.
    mod = sys.modules.get("torch_npu")
    if mod is None:
        return False
    is_init = getattr(getattr(mod, "npu", None), "is_initialized", None)
    return True if is_init is None else bool(is_init())


def _load():
    from chipset_ascend import backend

    return backend.spec


def _profiles():
    from chipset_ascend.properties import profiles

    return profiles()


descriptor = BackendDescriptor(
    name="ascend",
    api_version=(1, 1),
    priority=90,
    device_types=("npu",),
    probe=_probe,
    load=_load,
    description="Huawei Ascend NPUs through torch_npu and HCCL.",
    kernels=("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "swiglu", "fused_adamw"),
    profiles=_profiles,
    device_initialized=_device_initialized,
)
