"""The per-kernel compute model (kernels.py) and ZeRO-3 overlap: behaviour that could fail."""

from __future__ import annotations

import math

import pytest

from chipset.models.family import TransformerFamily
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster, list_profiles
from chipset.planner.kernels import gemm_time
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import PRESETS
from chipset.planner.time import evaluate, overlapped

PEAK, BW = 1e15, 3e12


def test_skinny_gemms_reach_a_smaller_fraction_of_peak_than_square_ones():
    a = Assumptions()
    square = 2 * 4096**3 / gemm_time(4096, 4096, 4096, PEAK, BW, a.gemm_efficiency, a.gemm_half_dim)
    skinny = 2 * 4096 * 4096 * 64 / gemm_time(4096, 64, 4096, PEAK, BW, a.gemm_efficiency, a.gemm_half_dim)
    assert square / PEAK > 0.95 * a.gemm_efficiency
    assert skinny / PEAK < 0.55 * a.gemm_efficiency  # d = 64 = gemm_half_dim halves it


def test_a_gemm_with_one_token_is_bound_by_memory_bandwidth():
    a = Assumptions()
    t = gemm_time(1, 8192, 8192, PEAK, BW, a.gemm_efficiency, a.gemm_half_dim)
    assert t == 2 * (8192 + 8192 * 8192 + 8192) / BW


def test_overlap_costs_more_than_the_longer_of_the_two():
    assert overlapped(2.0, 1.0, 0.0) == 2.0
    assert overlapped(2.0, 1.0, 0.3) == 2.3


def test_zero3_exposed_communication_grows_as_the_per_device_batch_shrinks():
    """Narayanan et al. Table 2's shape: at a fixed global batch, doubling dp halves each
    device's compute but not its parameter-gather traffic, so more of it is exposed."""
    profiles = list_profiles()
    dev = profiles["a100-80g"][1]
    m = PRESETS["gpt3-175b"]
    exposed = []
    for n, b in ((384, 4), (1536, 1)):
        cl = Cluster(n // 8, 8, dev, "a100-80g")
        p = evaluate(m, Layout(dp=n, zero=3, micro_batch=b, recompute="full"), TrainSpec(global_batch=1536), cl)
        exposed.append(p.breakdown["dp_exposed"] / p.step_time_s)
        assert p.breakdown["dp_exposed"] <= p.breakdown["dp_total"] * 1.3 + 1e-9
    assert exposed[1] > exposed[0] + 0.3


def test_a_profiles_declared_gemm_curve_is_the_one_the_planner_uses():
    """DeviceProperties.matmul_half_dim shapes every GEMM's efficiency; 0 falls back to
    Assumptions.gemm_half_dim, so declaring the default changes nothing."""
    import dataclasses

    dev = list_profiles()["sim-generic"][1]
    m = PRESETS["tiny"]
    lay = Layout(dp=1, micro_batch=2)

    def step(**declared):
        cl = Cluster(1, 1, dataclasses.replace(dev, **declared), "sim-generic")
        return evaluate(m, lay, TrainSpec(global_batch=2), cl).breakdown["roofline"]

    default = step(matmul_half_dim=0.0)
    assert step(matmul_half_dim=float(Assumptions().gemm_half_dim)) == default
    assert step(matmul_half_dim=4096.0) > 1.5 * default  # a curve that needs wide GEMMs slows tiny ones
    assert step(matmul_half_dim=1.0) < default


def _recomputed_gemm_flops_measured(early_stop: bool) -> tuple[float, object]:
    """GEMM FLOPs chipset's transformer runs more under ``train.recompute=full`` than without,
    counted by torch's FlopCounterMode over one forward and backward (matrix products of the
    projections and the logit layer; the attention core's batched products are left out)."""
    import torch
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    import chipset
    from chipset.data.datasets import SyntheticTokens
    from chipset.models import Transformer
    from chipset.parallel.recompute import apply_recompute
    from chipset.train.config import load_config

    cfg = load_config(None, ["train.recompute=full", "train.seq_len=16", "train.global_batch=2"])
    data = SyntheticTokens(cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch, seed=0)
    tokens, targets = data.batch(0)
    counted = {}
    for mode in ("none", "full"):
        model = Transformer(cfg.model, chipset.backend().kernels, seed=1)
        apply_recompute(model, mode=mode, family=TransformerFamily())
        with set_checkpoint_early_stop(early_stop), FlopCounterMode(display=False) as fc:
            model.loss(tokens, targets).backward()
        ops = fc.get_flop_counts()["Global"]
        counted[mode] = sum(n for op, n in ops.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    return counted["full"] - counted["none"], cfg


@pytest.mark.parametrize("early_stop", [True, False])
def test_full_recompute_reruns_the_gemms_torch_reruns(early_stop):
    """The planner's recomputed GEMM FLOPs equal what torch executes: with early stop (torch's
    default, chipset's engine) a block's MLP output projection is not rerun; without it the
    whole forward is. Each setting's count differs from the other's, so a planner that modelled
    the wrong one fails."""
    import dataclasses

    from chipset.planner.kernels import stage_compute
    from chipset.planner.run import from_run_config

    measured, cfg = _recomputed_gemm_flops_measured(early_stop)
    m, lay, train = from_run_config(cfg, world_size=1)
    counts = {}
    for flag in (True, False):
        t = dataclasses.replace(train, recompute_early_stop=flag)
        per_mode = {rc: stage_compute(m, dataclasses.replace(lay, recompute=rc), cfg.train.seq_len, t, m.layers,
                                      PEAK, BW, Assumptions(), 0.7, 0.4).gemm_flops for rc in ("none", "full")}
        counts[flag] = per_mode["full"] - per_mode["none"]
    assert measured > 0 and counts[True] != counts[False]
    assert measured == counts[early_stop], (measured, counts)


def test_the_loss_is_charged_per_logit_by_the_kernel_that_computes_it():
    """The last stage's loss moves TrainSpec.loss_bytes per logit at memory_efficiency x the
    bandwidth: three passes over bf16 logits for a fused cross-entropy (the planner's
    default), 36 bytes for an eager fp32 one; nothing on a stage without the logits."""
    import dataclasses

    from chipset.planner.kernels import loss_bytes_per_logit, stage_compute

    m = PRESETS["llama2-7b"]
    lay, a = Layout(micro_batch=2), Assumptions()
    tokens = 2 * m.seq_len

    def memory(train, with_logits=True, model=m):
        return stage_compute(model, lay, m.seq_len, train, m.layers, PEAK, BW, a, 0.7, 0.4,
                             with_logits=with_logits).memory_s

    blocks_only = memory(TrainSpec(), with_logits=False)
    fused = memory(TrainSpec()) - blocks_only
    eager = memory(TrainSpec(loss_bytes=loss_bytes_per_logit(2))) - blocks_only
    per_byte = tokens * m.vocab / (BW * a.memory_efficiency)
    assert math.isclose(fused, 6 * per_byte) and math.isclose(eager, 36 * per_byte)
    reference = memory(TrainSpec(), model=dataclasses.replace(m, kernels="reference")) - blocks_only
    assert math.isclose(reference, eager)
    assert loss_bytes_per_logit(4) == 24  # fp32 logits: no casts
