"""The per-kernel compute model (kernels.py) and ZeRO-3 overlap: behaviour that could fail."""

from __future__ import annotations

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
