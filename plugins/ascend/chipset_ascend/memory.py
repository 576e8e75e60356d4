"""NPU memory through torch.npu's caching allocator (chipset-accelerator's mapping: torch_npu
keeps the CUDA allocator's statistics layout), and torch_npu's OOM message as chipset's."""

from __future__ import annotations

import re

from chipset.errors import OutOfMemoryError
from chipset_accelerator.memory import AcceleratorMemory
from chipset_ascend._runtime import DEVICE_TYPE

# torch_npu's allocator message, e.g. "NPU out of memory. Tried to allocate 52.00 MiB
# (NPU 0; 60.96 GiB total capacity; ...)". Older torch_npu raises RuntimeError with
# it, newer raises torch.OutOfMemoryError; both are recognised.
_DEVICE_IN_MESSAGE = re.compile(r"\(NPU (\d+);")


class AscendMemory(AcceleratorMemory):
    backend_name = "ascend"
    oom_markers = ("npu out of memory",)

    # --- OOM translation: only the narrow hooks, the message is core's --------
    def translate_oom(self, exc: BaseException, device: str = "") -> OutOfMemoryError | None:
        if not device and not isinstance(exc, OutOfMemoryError):
            m = _DEVICE_IN_MESSAGE.search(str(exc))
            if m:
                device = f"{DEVICE_TYPE}:{m.group(1)}"
        return super().translate_oom(exc, device)
