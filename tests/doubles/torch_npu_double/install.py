"""Install the torch_npu TEST DOUBLE into one test (in-process) or a subprocess environment.

Used by tests/plugins/test_ascend_*.py. Everything it changes is undone through pytest's
``monkeypatch``: sys.path, environment, ``torch.npu`` and the modules it imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
"""The folder that holds the ``torch_npu`` double package (put it on sys.path / PYTHONPATH)."""


def purge_modules() -> None:
    """Forget the double and chipset_ascend's load()-reached modules (they bound the double)."""
    for name in list(sys.modules):
        if name == "torch_npu" or name.startswith("torch_npu.") or name.startswith("chipset_ascend."):
            del sys.modules[name]


def path_only(monkeypatch) -> None:
    """Make ``torch_npu`` findable (as if pip-installed) without importing it."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(torch, "npu", None, raising=False)  # recorded, so teardown removes torch.npu
    monkeypatch.delattr(torch, "npu")
    purge_modules()


def install(monkeypatch, tmp_path, *, devices: int = 8, soc: str = "Ascend910B3", env: dict | None = None):
    """Make the double importable, set a CANN home and NPU device files; return the imported double."""
    import chipset_ascend
    from chipset.discovery import records

    path_only(monkeypatch)
    cann = tmp_path / "cann"
    cann.mkdir(exist_ok=True)
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    for i in range(devices):
        (dev / f"davinci{i}").touch()
    monkeypatch.setattr(chipset_ascend, "DEVICE_FILES_GLOB", str(dev / "davinci[0-9]*"))
    for k in ("ASCEND_RT_VISIBLE_DEVICES", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "CHIPSET_COLLECTIVE_TIMEOUT", "CHIPSET_ASCEND_ALLOW_HF32", "TORCH_NPU_DOUBLE_OOM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    monkeypatch.setenv("TORCH_NPU_DOUBLE_DEVICES", str(devices))
    monkeypatch.setenv("TORCH_NPU_DOUBLE_SOC", soc)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    records.clear_cache()
    import torch_npu

    torch_npu._double.reset()
    return torch_npu


def subprocess_env(extra: dict | None = None) -> dict[str, str]:
    """Environment for a subprocess that should find the double (chipset vars stripped)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "ASCEND_", "HCCL_", "TORCH_NPU_DOUBLE"))}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    e.update(extra or {})
    return e
