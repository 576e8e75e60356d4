"""chipset-accelerator, the generic backend: its probe on this torch and on TEST DOUBLES of
other builds (tests/doubles/fake_xpu.py), its device/memory/collective mapping of a device
module, the Intel profiles, and the conformance suite on the PrivateUse1 TEST DOUBLE
(tests/doubles/privateuse1_double: a renamed PrivateUse1 device whose tensors live on the host).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from doubles.fake_xpu import MAX_1550, FakeTorchCpuBuild, FakeTorchXpuBuild, FakeXpu

import chipset_accelerator
import forked_cli
from chipset.errors import ConfigError, DeviceIndexError
from chipset_accelerator.backend import capabilities_for
from chipset_accelerator.collective import AcceleratorCollective
from chipset_accelerator.device import AcceleratorDevice
from chipset_accelerator.memory import AcceleratorMemory
from chipset_accelerator.properties import profiles

DOUBLE = Path(__file__).parents[1] / "doubles" / "privateuse1_double"


def test_probe_on_this_torch_build_says_why():
    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("this torch build has an accelerator")
    ok, reason = chipset_accelerator.descriptor.probe()
    assert not ok and "no accelerator in this torch build" in reason and torch.__version__ in reason


def test_probe_reads_the_build_the_device_module_and_torchs_collective_map():
    assert chipset_accelerator._probe(FakeTorchCpuBuild())[0] is False
    ok, reason = chipset_accelerator._probe(FakeTorchXpuBuild())
    assert ok and "xpu device(s) available" in reason and "'xccl'" in reason  # torch's own xpu -> xccl
    ok, reason = chipset_accelerator._probe(FakeTorchXpuBuild(available=False))
    assert not ok and "torch.xpu.is_available() is False" in reason
    ok, reason = chipset_accelerator._probe(FakeTorchXpuBuild(device_type="mps"))
    assert ok and "one process only" in reason  # torch maps mps to gloo, which cannot carry MPS tensors


def test_an_xpu_module_maps_onto_device_memory_and_collective(monkeypatch):
    fake = FakeXpu()
    dev = AcceleratorDevice("xpu", module=fake)
    assert dev.device_type == "xpu" and dev.device_count() == 2
    dev.set_device(1)
    assert fake.current_device() == 1 and dev.torch_device() == torch.device("xpu", 1)
    fake.stats[1] = {"allocated_bytes.all.current": 512, "reserved_bytes.all.current": 2048,
                     "allocated_bytes.all.peak": 1024}
    s = AcceleratorMemory(dev).stats()
    assert (s.allocated, s.reserved, s.peak_allocated, s.active) == (512, 2048, 1024, 0)
    assert AcceleratorMemory(dev).mem_get_info(0) == (64 * 2**30, 128 * 2**30)
    assert AcceleratorCollective(dev).c10d_backend == "xccl"
    caps = capabilities_for(dev)
    assert caps.multi_process and "bfloat16" in caps.amp_dtypes and caps.memory_accounting == "exact"
    assert not caps.streams and not caps.event_timing  # this module has no Stream/Event: not declared
    assert "bfloat16" not in capabilities_for(AcceleratorDevice("xpu", module=FakeXpu(bf16=False))).dtypes
    monkeypatch.setenv("CHIPSET_ACCELERATOR_VISIBLE_DEVICES", "1")
    assert dev.device_count() == 1
    dev.set_device(0)
    assert fake.current_device() == 1 and dev.current_device() == 0
    with pytest.raises(DeviceIndexError, match="CHIPSET_ACCELERATOR_VISIBLE_DEVICES"):
        dev.set_device(1)
    monkeypatch.setenv("CHIPSET_ACCELERATOR_VISIBLE_DEVICES", "0,7")
    with pytest.raises(ConfigError, match="below 2"):
        dev.device_count()


def test_max_1550_properties_are_the_profile_and_unknown_parts_declare_no_rates():
    p = AcceleratorDevice("xpu", module=FakeXpu()).properties(0)
    profile = profiles()["max-1550"]
    assert p.name == MAX_1550[0] and not p.estimated and p.peak_flops == profile.peak_flops
    assert p.peak_flops_for("bfloat16") == pytest.approx(128 * 1.6e9 * 4096, rel=1e-3)  # Xe cores x clock x FLOP/clk
    other = AcceleratorDevice("xpu", module=FakeXpu(gpus=[("Intel(R) Arc(TM) A770", 16 * 2**30)])).properties(0)
    assert other.estimated and other.peak_flops == {} and "no chipset profile" in other.source
    assert profiles()["max-1100"].peak_flops_for("float32") == pytest.approx(56 * 1.55e9 * 256, rel=1e-3)


@pytest.fixture(scope="module")
def conformance_on_the_privateuse1_double(tmp_path_factory):
    report = tmp_path_factory.mktemp("pu1") / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(DOUBLE), env.get("PYTHONPATH")])),
               TOY_ACCEL_DOUBLE="1", TOY_ACCEL_DOUBLE_CAPACITY=str(2**30))
    # A slice (devices, memory, streams, RNG, one collective world); tox's
    # conformance-privateuse1-double env runs the whole suite.
    proc = forked_cli.run(
        [sys.executable, "-m", "chipset.cli.main", "conformance", "--backend", "accelerator", "-q",
         "-k", "test_device or test_memory or test_streams or test_rng or all_reduce_avg-int64",
         "--json-report", str(report)],
        env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(report.read_text()) if report.exists() else None


def test_conformance_passes_on_a_device_torch_does_not_ship(conformance_on_the_privateuse1_double):
    proc, report = conformance_on_the_privateuse1_double
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] >= 40
    groups = {t["group"] for t in report["tests"] if t["outcome"] == "passed"}
    assert {"device", "memory", "streams", "rng", "collectives"} <= groups


def test_the_double_is_reached_only_through_torchs_common_surface():
    code = ("import json, torch, toy_accel, chipset\n"
            "from chipset.discovery.build import build_report\n"
            "from chipset.discovery.records import discover\n"
            "b = chipset.backend()\n"
            "rep = build_report(discover())\n"
            "print(json.dumps([b.name, torch.accelerator.current_accelerator().type, b.device.accelerator_type,"
            " b.collective.c10d_backend, torch.distributed.get_default_backend_for_device('toyacc'),"
            " rep['accelerator'], sorted(r['backend'] for r in rep['could_serve'])]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(DOUBLE), env.get("PYTHONPATH")])), TOY_ACCEL_DOUBLE="1",
               CHIPSET_DISABLE_PLUGINS="cpu")
    out = forked_cli.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "accelerator", "toyacc", "toyacc", "toyccl", "toyccl", "toyacc", ["accelerator", "cpu_sim"]]  # cpu is disabled here


def test_backends_explains_which_backends_could_serve_this_build(capsys):
    from chipset.cli.main import main

    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("this torch build has an accelerator")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "no accelerator in this build" in out
    serve = next(line for line in out.splitlines() if "could serve it:" in line)
    other = next(line for line in out.splitlines() if "need another torch build" in line)
    assert "cpu_sim (ok)" in serve and "accelerator" not in serve
    assert "accelerator (any accelerator)" in other and "cuda (cuda)" in other


@pytest.mark.parametrize("target, backend", [("rocm", "cuda"), ("xpu", "accelerator")])
def test_the_rocm_and_xpu_gpu_checks_record_each_step_with_the_reason_here(tmp_path, target, backend):
    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("this torch build has an accelerator: run plugins/accelerator/gpu_check.sh instead")
    script = Path(__file__).resolve().parents[2] / "plugins" / "accelerator" / "gpu_check.py"
    r = forked_cli.run([sys.executable, str(script), "--target", target, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data["steps"]) == ["environment", "chipset_backends", "probe_fork_safe", "interfaces",
                                   "collective_world1", "gemm_bf16", "conformance"]
    assert data["steps"]["environment"]["ok"] and not data["all_ok"]
    assert f"{backend} is unavailable" in data["steps"]["chipset_backends"]["error"]
    assert all("backend unavailable" in s["skipped"] for s in list(data["steps"].values())[2:])
    assert "| chipset_backends |" in (tmp_path / "gpu_check.md").read_text()
