"""The prepared GPU check degrades cleanly where there is no GPU: every step recorded, reasons kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run plugins/cuda/gpu_check.sh instead")
def test_gpu_check_without_a_gpu_records_each_step_with_the_reason(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = data["steps"]
    assert list(steps) == ["environment", "chipset_backends", "chipset_info", "probe_fork_safe", "interfaces",
                           "collective_nccl_world1", "kernels_vs_reference", "kernel_speed", "throughput",
                           "gemm_curve", "train_gpt_1b", "engine_train", "plain_torch_gpu", "conformance"]
    assert steps["environment"]["ok"] and steps["environment"]["detail"]["torch"] == torch.__version__
    assert not data["all_ok"]
    assert "cuda is unavailable" in steps["chipset_backends"]["error"]
    assert all("unavailable" in s["error"] for name, s in steps.items() if name not in ("environment", "probe_fork_safe"))
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| chipset_backends | RuntimeError: cuda is unavailable" in summary
