"""The prepared GPU check degrades cleanly where there is no GPU: every step recorded, reasons kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "plugins" / "cuda" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run plugins/cuda/gpu_check.sh instead")
def test_gpu_check_without_a_gpu_records_each_step_with_the_reason(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = data["steps"]
    assert list(steps) == ["environment", "chipset_backends", "chipset_info", "probe_fork_safe", "interfaces",
                           "collective_nccl_world1", "kernels_vs_reference", "kernel_speed", "throughput",
                           "gemm_curve", "mpt_blocks", "train_gpt_1b", "engine_train", "plain_torch_gpu",
                           "conformance"]
    assert steps["environment"]["ok"] and steps["environment"]["detail"]["torch"] == torch.__version__
    assert not data["all_ok"]
    assert "cuda is unavailable" in steps["chipset_backends"]["error"]
    assert all("unavailable" in s["error"] for name, s in steps.items() if name not in ("environment", "probe_fork_safe"))
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| chipset_backends | RuntimeError: cuda is unavailable" in summary


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_planners_measured_steps_are_the_shapes_the_gpu_check_trains():
    """chipset.planner.measured_steps costs the work of the GPU check's three training steps:
    its rows must stay the shapes and batches the check runs, or the comparison means nothing."""
    from chipset.planner.measured_steps import H200_STEPS

    gc = _gpu_check_module()
    shapes = {"train_gpt_1b": gc.TRAIN_GPT_SHAPE, "engine_train": gc.ENGINE_SHAPE, "plain_torch_gpu": gc.ENGINE_SHAPE}
    assert {r.step for r in H200_STEPS} == set(shapes)
    for r in H200_STEPS:
        s = shapes[r.step]
        m = r.model
        assert (m.hidden, m.layers, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len, r.batch) == (
            s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["ffn"], s["vocab"], s["seq"], s["batch"]), r.step


def test_the_summary_shows_each_step_beside_the_planner():
    gc = _gpu_check_module()
    detail = {"measured_step_ms": 234.0, "planner_step_ms": 237.3, "planner_error": -0.0139}
    data = {"started": "now", "steps": {"environment": {"ok": True, "detail": {}},
                                        "engine_train": {"ok": True, "detail": {**detail, "median_tokens_per_s": 1,
                                                                                "median_mfu": 0.5, "peak_memory_gib": 1,
                                                                                "loss_first_last": [2, 1]}}},
            "seconds": 1, "all_ok": True}
    text = gc.summary(data)
    assert "| engine_train | 234.0 | 237.3 | -1.4% |" in text


def test_the_mpt_blocks_the_gpu_check_times_are_the_planners_mpt_blocks():
    """Step mpt_blocks times stock-torch MPT blocks beside the planner's cost of ``_mpt``'s
    blocks: same parameters per block, and the block runs forward and backward (here on
    the CPU, small)."""
    import torch

    from chipset.planner.published import _mpt

    gc = _gpu_check_module()
    for cfg in gc.MPT_BLOCKS:
        stack = gc.mpt_block_stack(cfg["hidden"], cfg["heads"], 1).to("meta")
        spec = _mpt(cfg["hidden"], cfg["heads"], cfg["layers"])
        # the planner's norms carry a bias in its count (gpt3's layernorm); MPT's have none
        norm_bias = 2 * cfg["hidden"] if spec.norm == "layernorm" else 0
        assert sum(p.numel() for p in stack.parameters()) == spec.layer_params(False) - norm_bias, cfg["name"]
    small = gc.mpt_block_stack(64, 4, 2)
    x = torch.randn(2, 16, 64, requires_grad=True)
    small(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in small.parameters())
