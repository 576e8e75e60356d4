"""chipset-cuda on a ROCm build of torch (AMD GPUs through torch.cuda on HIP), against the
TEST DOUBLES in tests/doubles/fake_rocm.py: the probe names the AMD device and driver and
never advises a CUDA build, the MI200/MI300 profiles, dtypes and capabilities, RCCL under
the ``nccl`` name, and the Triton kernels left out."""

from __future__ import annotations

import pytest
import torch
from doubles.fake_cuda import FakeTorchForProbe
from doubles.fake_rocm import MI250X_GCD, FakeRocmCuda, FakeTorchRocmForProbe

import chipset_cuda
from chipset.kernels import KernelRegistry
from chipset_cuda import backend, kernels
from chipset_cuda.collective import CudaCollective
from chipset_cuda.device import CudaDevice

GiB = 2**30


@pytest.fixture(autouse=True)
def _no_visibility(monkeypatch):
    for var in chipset_cuda.ROCM_VISIBLE_ENVS:
        monkeypatch.delenv(var, raising=False)


def test_probe_names_the_amd_gpus_the_driver_and_rccl():
    ok, reason = chipset_cuda._probe(FakeTorchRocmForProbe())
    assert ok and "AMD GPU(s)" in reason and "HIP 6.4.43482" in reason and "amdgpu" in reason and "RCCL" in reason
    for present, words in ((-1, "no AMD GPU driver"), ("oserror", "no AMD GPU driver"), (0, "reports zero GPUs")):
        ok, reason = chipset_cuda._probe(FakeTorchRocmForProbe(present=present))
        assert not ok and words in reason and "CUDA build" not in reason, reason


def test_probe_explains_rocm_visibility(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert "HIP_VISIBLE_DEVICES is set to an empty string" in chipset_cuda._probe(FakeTorchRocmForProbe())[1]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "99")
    ok, reason = chipset_cuda._probe(FakeTorchRocmForProbe(present=8))
    assert not ok and "8 AMD GPU(s) present" in reason and "HIP_VISIBLE_DEVICES" in reason


def test_a_cpu_only_build_is_told_about_both_gpu_builds():
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(cuda_version=None))
    assert not ok and "CUDA build" in reason and "ROCm build for AMD GPUs" in reason


def test_mi300x_properties_dtypes_and_capabilities():
    dev = CudaDevice(cuda=FakeRocmCuda(), hip="6.4.43482")
    p = dev.properties(0)
    profile = chipset_cuda.descriptor.profiles()["mi300x"]
    assert p.name == "AMD Instinct MI300X" and not p.estimated and p.peak_flops == profile.peak_flops
    assert p.total_memory == int(191.98 * GiB) and p.multiprocessor_count == 304 and "mi300x" in p.source
    assert torch.float8_e4m3fnuz in dev.supported_dtypes and torch.float8_e4m3fn not in dev.supported_dtypes
    caps = backend.spec.capabilities(dev)
    assert "bfloat16" in caps.amp_dtypes and "bfloat16" in caps.collective_dtypes
    assert not caps.graph_capture and caps.streams and caps.multi_process  # HIP graphs: not declared, unverified
    assert CudaCollective(dev).c10d_backend == "nccl"  # RCCL answers to the nccl name on ROCm


def test_mi200_and_unknown_amd_parts():
    gcd = CudaDevice(cuda=FakeRocmCuda(gpus=[MI250X_GCD]), hip="6.4").properties(0)
    assert gcd.peak_flops_for("bfloat16") == 383e12 / 2 and gcd.peak_flops_for("float8_e4m3fnuz") == 0.0
    other = CudaDevice(cuda=FakeRocmCuda(gpus=[("AMD Radeon PRO W7900", 48 * GiB, (11, 0), 96, "gfx1100")]),
                       hip="6.4").properties(0)
    # No NVIDIA per-SM estimate for an AMD part: its name and memory, no rates.
    assert other.estimated and other.peak_flops == {} and "no chipset profile for AMD part" in other.source


def test_mi325x_profile_is_the_mi300x_die_with_more_and_faster_memory():
    profiles = chipset_cuda.descriptor.profiles()
    mi300x, mi325x = profiles["mi300x"], profiles["mi325x"]
    assert mi325x.peak_flops == mi300x.peak_flops
    assert (mi325x.total_memory, mi325x.memory_bandwidth) == (256 * GiB, 6.0e12)
    assert mi300x.memory_bandwidth == 5.3e12 and mi300x.peak_flops_for("bfloat16") == 1307.4e12


def test_triton_kernels_are_left_out_on_rocm(monkeypatch):
    monkeypatch.setattr(kernels, "triton_importable", lambda: True)
    reg = KernelRegistry("cuda")
    backend.spec.register_kernels(reg, CudaDevice(cuda=FakeRocmCuda(), hip="6.4"))
    registered = {n for n in reg.names() if reg.implementations(n)}
    assert registered == {"scaled_dot_product_attention", "fused_adamw"}


def test_launch_env_carries_rocm_visibility(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    assert backend.spec.launch_env(0, 2)["HIP_VISIBLE_DEVICES"] == "0,1"
