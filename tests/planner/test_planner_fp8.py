"""The planner's FP8 projection (train.fp8): projections at the FP8 peak, everything else at train.dtype's.

On a profile whose FP8 peak is twice its bf16 peak and with no memory roofline (bandwidth 0, so
every GEMM's time is its FLOPs over its peak times the same efficiency curve), a dense model's
block GEMMs are all attention and MLP projections: their time halves, the vocabulary head's and
the attention core's do not. So with B = the blocks' GEMM seconds and L = the head's (from the
bf16 projection with and without the head), FP8 predicts L + B/2, and the same attention time.
Costing the head in FP8 too, or ignoring FP8, misses it by at least L/2 or B/2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from chipset.errors import ConfigError
from chipset.interfaces.device import DeviceProperties
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster
from chipset.planner.kernels import device_stage_compute
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import PRESETS
from chipset.planner.time import evaluate

BF16 = 400e12
DEV = DeviceProperties(name="fp8-test", index=0, total_memory=80 * 2**30,
                       peak_flops={"bfloat16": BF16, "float8_e4m3fn": 2 * BF16}, memory_bandwidth=0.0,
                       intra_node_bandwidth=300e9, inter_node_bandwidth=25e9)
M = PRESETS["llama2-7b"]
LAY = Layout(dp=8, zero=1, micro_batch=1)


def _stage(fp8: str, logits: bool = True, dev=DEV):
    return device_stage_compute(M, LAY, M.seq_len, TrainSpec(global_batch=64, fp8=fp8), M.layers, dev, Assumptions(),
                                with_logits=logits)


def test_fp8_runs_the_projections_at_the_fp8_peak_and_the_rest_at_the_train_dtype_peak():
    off, off_blocks = _stage("off"), _stage("off", logits=False)
    head = off.gemm_s - off_blocks.gemm_s
    on = _stage("tensorwise")
    assert head > 0 and off_blocks.gemm_s > 0
    assert math.isclose(on.gemm_s, head + off_blocks.gemm_s / 2, rel_tol=1e-12)
    assert on.attention_s == off.attention_s and on.gemm_flops == off.gemm_flops
    # Each GEMM at its own peak: the efficiency is the curve's, not doubled by FP8.
    assert math.isclose(on.gemm_efficiency(BF16), off.gemm_efficiency(BF16), rel_tol=1e-12)


def test_fp8_shortens_the_step_and_mfu_stays_relative_to_the_bf16_peak():
    cl = Cluster(nodes=1, devices_per_node=8, device=dataclasses.replace(DEV, memory_bandwidth=3e12), profile="fp8-test")
    off = evaluate(M, LAY, TrainSpec(global_batch=64), cl)
    on = evaluate(M, LAY, TrainSpec(global_batch=64, fp8="rowwise"), cl)
    assert on.step_time_s < off.step_time_s
    assert math.isclose(on.mfu / off.mfu, off.step_time_s / on.step_time_s, rel_tol=1e-12)
    no_fp8 = dataclasses.replace(cl, device=dataclasses.replace(cl.device, peak_flops={"bfloat16": BF16}))
    with pytest.raises(ConfigError, match="declares no FP8 peak"):
        evaluate(M, LAY, TrainSpec(global_batch=64, fp8="tensorwise"), no_fp8)


def test_a_run_config_with_fp8_plans_with_it():
    from chipset.planner.run import from_run_config
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict({"train": {"fp8": "tensorwise", "dtype": "bfloat16"}})
    assert from_run_config(cfg, world_size=1)[2].fp8 == "tensorwise"
