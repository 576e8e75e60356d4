"""Layering rules: core names no vendor API, and importing chipset stays light."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

VENDOR = re.compile(r'torch\.cuda|torch\.npu|torch_npu|\.cuda\(|"nccl"|"hccl"|\'nccl\'|\'hccl\'')


def test_core_names_no_vendor_api():
    hits = []
    for path in (ROOT / "core" / "chipset").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR.search(line) and "chipset: allow-vendor-name" not in line:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "vendor API names in core/ (move them into a plugin):\n" + "\n".join(hits)


def test_the_vendor_check_itself_catches_each_name():
    for line in ("x = torch.cuda.current_device()", "import torch_npu", "t.cuda()", 'backend="nccl"', "'hccl'", "torch.npu.synchronize()"):
        assert VENDOR.search(line), line


_PROBE = """
import sys, json, torch
import chipset
b = chipset.backend("cpu_sim")
chipset.list_backends()
heavy = [m for m in sys.modules if m.split('.')[0] in ('torch_npu', 'triton', 'apex', 'deepspeed')
         or m in ('chipset_cuda.backend', 'chipset_ascend.backend')]
print(json.dumps({"heavy": heavy, "cuda_initialised": torch.cuda.is_initialized()}))
"""


def test_import_and_resolve_import_no_vendor_module():
    import json

    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"heavy": [], "cuda_initialised": False}
