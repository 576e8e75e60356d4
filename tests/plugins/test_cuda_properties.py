"""chipset-cuda's datasheet table: lookups by CUDA device name, the cited figures, the estimate."""

from __future__ import annotations

import pytest

from chipset_cuda import properties as P

GiB = 2**30


@pytest.mark.parametrize(
    ("cuda_name", "memory", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", 40 * GiB, "a100-40g"),
        ("NVIDIA A100-SXM4-80GB", 80 * GiB, "a100-80g"),
        ("NVIDIA A100 80GB PCIe", 80 * GiB, "a100-80g-pcie"),
        ("NVIDIA A100-PCIE-40GB", 40 * GiB, "a100-40g"),
        ("NVIDIA H100 80GB HBM3", 80 * GiB, "h100-sxm"),
        ("NVIDIA H100 PCIe", 80 * GiB, "h100-pcie"),
        ("NVIDIA H100 NVL", 94 * GiB, "h100-nvl"),
        ("NVIDIA H200", 141 * GiB, "h200"),
        ("NVIDIA B200", 180 * GiB, "b200"),
    ],
)
def test_cuda_device_names_map_to_their_table_row(cuda_name, memory, key):
    assert P.lookup(cuda_name, memory).key == key


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA L4", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090"])
def test_parts_outside_the_table_are_not_guessed_from_a_similar_name(name):
    assert P.lookup(name, 24 * GiB) is None


def test_design_brief_bf16_peaks_match_the_table():
    # docs/formulas.md: dense bf16 A100 312, H100 SXM 989, H200 989 (same die) TFLOP/s.
    profiles = P.profiles()
    assert profiles["a100-80g"].peak_flops["bfloat16"] == 312e12
    assert profiles["h100-sxm"].peak_flops["bfloat16"] == pytest.approx(989e12, rel=1e-3)
    assert profiles["h200"].peak_flops == profiles["h100-sxm"].peak_flops


def test_only_hopper_declares_the_gemm_curve_measured_on_an_h200():
    profiles = P.profiles()
    for key in ("h100-sxm", "h100-pcie", "h100-nvl", "h200"):
        assert profiles[key].matmul_half_dim == 128.0, key
    for key in ("a100-80g", "a100-40g", "b200"):
        assert profiles[key].matmul_half_dim == 0.0, key  # not measured: the planner's default


def test_rows_are_dense_rates_with_the_expected_ratios():
    for key, spec in P.SPECS.items():
        assert spec.bf16 == spec.fp16, key
        assert spec.tf32 == pytest.approx(spec.bf16 / 2, rel=0.01), key
        if spec.fp8:
            assert spec.fp8 == pytest.approx(spec.bf16 * 2, rel=0.01), key
        assert spec.source, key
    assert not P.SPECS["a100-80g"].fp8 and "float8_e4m3fn" not in P.SPECS["a100-80g"].peak_flops()


def test_profiles_carry_bandwidths_and_are_not_estimates():
    h200 = P.profiles()["h200"]
    assert h200.memory_bandwidth == 4.8e12
    assert h200.intra_node_bandwidth == 450e9  # NVLink 900 GB/s bidirectional, per direction
    assert h200.total_memory == 141 * GiB
    assert h200.compute_capability == (9, 0) and h200.multiprocessor_count == 132
    assert not h200.estimated and "H200 datasheet" in h200.source


def test_describe_keeps_measured_memory_and_sms_with_table_rates():
    props = P.describe("NVIDIA H100 80GB HBM3", 3, 85_520_809_984, (9, 0), 132)
    assert props.index == 3 and props.total_memory == 85_520_809_984
    assert props.peak_flops["float8_e4m3fn"] == pytest.approx(1978.9e12)
    assert not props.estimated and "h100-sxm" in props.source


def test_unknown_parts_get_a_clearly_labelled_estimate():
    # An L40S-like part: 142 SMs of compute capability 8.9 at its 2.52 GHz boost clock.
    props = P.describe("NVIDIA L40S", 0, 48 * GiB, (8, 9), 142, clock_hz=2.52e9)
    assert props.estimated
    assert props.source.startswith("ESTIMATE") and "not in chipset_cuda's datasheet table" in props.source
    # 142 x 2.52e9 x 1024 = 366 TFLOP/s; the L40S datasheet gives 362 dense: within 2 %.
    assert props.peak_flops["bfloat16"] == pytest.approx(362e12, rel=0.02)
    assert "float8_e4m3fn" in props.peak_flops


def test_estimate_without_a_clock_says_it_assumed_one_and_omits_unsupported_dtypes():
    props = P.estimate("Tesla V100-SXM2-16GB", 0, 16 * GiB, (7, 0), 80)
    assert props.estimated and "(assumed)" in props.source
    assert "bfloat16" not in props.peak_flops and props.peak_flops["float16"] > 0
