"""The Ascend probe: one actionable reason per way Ascend can be unavailable; never imports torch_npu."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import chipset_ascend
import forked_cli

_spec = importlib.util.spec_from_file_location("torch_npu_double_install", Path(__file__).parents[1] / "doubles" / "torch_npu_double" / "install.py")
double = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(double)


@pytest.fixture
def findable(monkeypatch, tmp_path):
    """torch_npu (the double) is installed, CANN is set, two NPU device files exist; nothing imported."""
    double.path_only(monkeypatch)
    (tmp_path / "cann").mkdir()
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        (dev / f"davinci{i}").touch()
    (dev / "davinci_manager").touch()  # not an NPU
    monkeypatch.setattr(chipset_ascend, "DEVICE_FILES_GLOB", str(dev / "davinci[0-9]*"))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "cann"))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    yield tmp_path
    double.purge_modules()


def probe() -> tuple[bool, str]:
    ok, reason = chipset_ascend.descriptor.probe()
    assert "torch_npu" not in sys.modules, "the probe imported torch_npu"
    return ok, reason


def test_available_when_everything_is_present(findable):
    ok, reason = probe()
    assert ok, reason
    assert "2 Ascend NPU(s)" in reason


def test_torch_npu_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_npu" else importlib.machinery.PathFinder.find_spec(name))
    ok, reason = probe()
    assert not ok and "torch_npu is not installed" in reason and "pip install torch-npu" in reason


def test_cuda_build_of_torch(findable, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    ok, reason = probe()
    assert not ok and "CUDA build" in reason and "CPU build of torch" in reason


def test_cann_environment_not_set(findable, monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH")
    ok, reason = probe()
    assert not ok and "ASCEND_HOME_PATH" in reason and "set_env.sh" in reason


def test_cann_home_that_does_not_exist(findable, monkeypatch):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(findable / "nowhere"))
    ok, reason = probe()
    assert not ok and "is not a directory" in reason


@pytest.mark.parametrize("value, words", [("", "empty string"), ("0,x", "comma-separated NPU ids")])
def test_bad_visible_devices(findable, monkeypatch, value, words):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", value)
    ok, reason = probe()
    assert not ok and words in reason


def test_visible_devices_are_reported(findable, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    ok, reason = probe()
    assert ok and "1 visible via ASCEND_RT_VISIBLE_DEVICES" in reason


def test_zero_devices(findable, monkeypatch):
    monkeypatch.setattr(chipset_ascend, "DEVICE_FILES_GLOB", str(findable / "dev" / "npu[0-9]*"))
    ok, reason = probe()
    assert not ok and "zero NPUs" in reason


def test_the_double_fails_to_import_like_torch_npu_without_cann(findable, monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH")
    with pytest.raises(ImportError, match="libhccl.so"):
        import torch_npu  # noqa: F401


def _backends_json(env: dict) -> dict:
    out = forked_cli.run(
        [sys.executable, "-m", "chipset.cli.main", "backends", "--json"],
        capture_output=True, text=True, env=double.subprocess_env(env), timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return {b["name"]: b for b in json.loads(out.stdout)["backends"]}


def test_cli_reports_each_reason(tmp_path):
    # torch_npu (the double) installed but CANN not sourced, then sourced on a machine
    # without NPUs: `chipset backends --json` shows each reason, and selection goes on.
    without_cann = _backends_json({})["ascend"]
    assert without_cann["status"] == "unavailable" and "ASCEND_HOME_PATH" in without_cann["reason"]
    no_npus = _backends_json({"ASCEND_HOME_PATH": str(tmp_path)})["ascend"]
    assert no_npus["status"] == "unavailable" and "zero NPUs" in no_npus["reason"]


def test_whole_process_harness_selects_ascend_and_the_engine_trains_on_it(tmp_path):
    # The double's subprocess harness (docs/ascend.md, layer 1): fake /dev/davinci files,
    # host placement. ascend then outranks cpu_sim, and `chipset train` runs on it.
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        (dev / f"davinci{i}").touch()
    env = {
        "ASCEND_HOME_PATH": str(tmp_path), "TORCH_NPU_DOUBLE_DEVICE_FILES": str(dev / "davinci[0-9]*"),
        "TORCH_NPU_DOUBLE_PLACE_ON_HOST": "1", "TORCH_NPU_DOUBLE_CAPACITY": str(1 << 30),
    }
    listing = _backends_json(env)
    assert listing["ascend"]["status"] == "ok" and "2 Ascend NPU(s)" in listing["ascend"]["reason"]
    run = forked_cli.run(
        [sys.executable, "-m", "chipset.cli.main", "train", "--set", "train.steps=2", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, env=double.subprocess_env(env), timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["backend"] == "ascend" and summary["steps"] == 2 and summary["final_loss"] == summary["final_loss"]
