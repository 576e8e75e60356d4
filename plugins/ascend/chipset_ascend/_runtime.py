"""Where torch_npu is reached: every backend module asks here, at call time.

Only modules reached from the descriptor's ``load()`` import this. Resolving
``torch_npu`` through ``sys.modules`` on each call (instead of binding it at import)
keeps a single place that names the vendor module.
"""

from __future__ import annotations

import importlib
from types import ModuleType

DEVICE_TYPE = "npu"
"""The torch device type torch_npu registers (PrivateUse1 renamed to ``"npu"``)."""


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (importing it registers ``torch.npu`` and the ``npu`` device)."""
    return importlib.import_module("torch_npu")


def npu() -> ModuleType:
    """``torch.npu``: device, memory, stream, event and RNG functions."""
    return torch_npu().npu
