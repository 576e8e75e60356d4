"""chipset-cuda's descriptor: the probe's reasons, fork safety, and the named profiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from doubles.fake_cuda import FakeTorchForProbe, ProbeTouchedCuda

import chipset_cuda
from chipset.discovery.profiles import all_profiles, get_profile
from conftest import run_cli


@pytest.fixture(autouse=True)
def _no_visible_override(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)


def test_probe_on_this_cpu_only_torch_says_it_is_not_a_cuda_build():
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    ok, reason = chipset_cuda.descriptor.probe()
    assert not ok
    assert "not a CUDA build" in reason and torch.__version__ in reason


def test_probe_reports_a_cpu_only_build_before_touching_torch_cuda():
    fake = FakeTorchForProbe(cuda_version=None)
    ok, reason = chipset_cuda._probe(fake)
    assert (ok, "not a CUDA build" in reason) == (False, True)
    assert fake.cuda.nvml_flag_seen == []


def test_probe_reports_a_missing_driver():
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(present=-1))
    assert not ok and "no NVIDIA driver" in reason


def test_probe_reports_a_missing_driver_when_nvml_raises():
    # torch 2.8 (the declared floor) raises OSError from _raw_device_count_nvml where
    # libnvidia-ml.so is absent: a CUDA build of torch on a GPU-less machine (PyPI's default).
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(present="oserror"))
    assert not ok and "no NVIDIA driver" in reason


def test_probe_reports_zero_devices():
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(present=0))
    assert not ok and "zero GPUs" in reason


def test_probe_reports_an_empty_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(present=4))
    assert not ok and "CUDA_VISIBLE_DEVICES is set to an empty string" in reason


def test_probe_reports_gpus_hidden_by_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    ok, reason = chipset_cuda._probe(FakeTorchForProbe(present=2, visible=0))
    assert not ok
    assert "2 GPU(s) present" in reason and "CUDA_VISIBLE_DEVICES='7'" in reason


def test_probe_accepts_visible_gpus_using_nvml_only_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake = FakeTorchForProbe(present=8, visible=2)
    ok, reason = chipset_cuda._probe(fake)
    assert ok and "CUDA 12.8" in reason and "CUDA_VISIBLE_DEVICES=0,1" in reason
    # is_available ran with the NVML-based check on, and the flag was removed afterwards
    assert fake.cuda.nvml_flag_seen == ["1"]
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ


def test_probe_keeps_a_users_own_nvml_setting(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    chipset_cuda._probe(FakeTorchForProbe(present=1))
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_the_probe_double_fails_on_apis_that_initialise_cuda():
    # The double must be able to catch a probe that reaches for a context-creating API.
    fake = FakeTorchForProbe()
    with pytest.raises(ProbeTouchedCuda):
        fake.cuda.device_count()
    with pytest.raises(ProbeTouchedCuda):
        fake.cuda.is_available()  # without PYTORCH_NVML_BASED_CUDA_CHECK=1


def test_descriptor_import_probe_and_profiles_load_nothing_heavy():
    code = (
        "import sys, json, torch\n"
        "import chipset_cuda\n"
        "ok, reason = chipset_cuda.descriptor.probe()\n"
        "names = sorted(chipset_cuda.descriptor.profiles())\n"
        "print(json.dumps({'cuda_initialized': torch.cuda.is_initialized(), 'names': names,\n"
        "  'loaded': sorted(m for m in sys.modules if m.startswith('chipset_cuda.') or m == 'triton')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cuda_initialized"] is False
    assert result["loaded"] == ["chipset_cuda.properties"]  # not backend, device, kernels or triton
    assert {"a100-80g", "h100-sxm", "h200", "b200"} <= set(result["names"])


def test_profiles_are_reachable_through_core_discovery():
    props = get_profile("h100-sxm")
    assert all_profiles()["h100-sxm"][0] == "cuda"
    assert props.peak_flops_for(torch.bfloat16) == pytest.approx(989e12, rel=1e-3)
    assert props.total_memory == 80 * 2**30 and not props.estimated


def test_chipset_backends_lists_cuda_unavailable_with_the_reason():
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    r = run_cli("backends", "--json")
    assert r.returncode == 0, r.stderr
    cuda = next(b for b in json.loads(r.stdout)["backends"] if b["name"] == "cuda")
    assert cuda["status"] == "unavailable" and "not a CUDA build" in cuda["reason"]
