"""Native flight recorders: the backends turn NCCL's / HCCL's on through their launch
environment, dumping into RUN_DIR/hangs/flight, and the launcher's hang report reads the dumps.

The CUDA and Ascend hooks are called for real (Ascend against the torch_npu TEST DOUBLE); the
dumps are written here in the documented shape of torch's flight recorder (a pickled dict with
an ``entries`` list), since no NCCL or HCCL runs on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
from pathlib import Path

import pytest

from chipset.interfaces.collective import FLIGHT_RECORDER_ENV, flight_recorder_file
from chipset.train.checkpoint.hangs import HANGS, diagnose, flight_dir

_spec = importlib.util.spec_from_file_location(
    "torch_npu_double_install", Path(__file__).parents[1] / "doubles" / "torch_npu_double" / "install.py")
double = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(double)


def test_no_run_directory_no_recorder(monkeypatch):
    monkeypatch.delenv(FLIGHT_RECORDER_ENV, raising=False)
    from chipset_cuda.backend import flight_recorder_env

    assert flight_recorder_file("nccl_trace") is None and flight_recorder_env() == {}


def test_cuda_turns_on_ncclss_recorder_into_the_run_directory(monkeypatch, tmp_path):
    from chipset_cuda import backend

    monkeypatch.setenv(FLIGHT_RECORDER_ENV, str(flight_dir(tmp_path)))
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own value is kept
    env = backend.spec.launch_env(0, 1)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(flight_dir(tmp_path) / "nccl_trace_rank_")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert flight_dir(tmp_path).is_dir()


def test_ascend_turns_on_hccls_recorder(monkeypatch, tmp_path):
    double.install(monkeypatch, tmp_path)
    try:
        from chipset_ascend import backend

        monkeypatch.setenv(FLIGHT_RECORDER_ENV, str(flight_dir(tmp_path)))
        env = backend.spec.launch_env(0, 1)
        assert env["TORCH_HCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_HCCL_ENABLE_MONITORING"] == "1"
        assert env["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"].endswith(os.path.join("flight", "hccl_trace_rank_"))
    finally:
        double.purge_modules()


def _dump(path: Path, entries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"version": "2.4", "pg_config": {}, "entries": entries}))


def test_the_hang_report_names_each_dumps_last_collective(tmp_path):
    (tmp_path / HANGS).mkdir()
    (tmp_path / HANGS / "rank0.json").write_text(json.dumps(
        {"rank": 0, "timeout": False, "error": "watchdog", "recent_ops": []}))
    _dump(flight_dir(tmp_path) / "nccl_trace_rank_1", [
        {"collective_seq_id": 6, "profiling_name": "nccl:all_reduce", "state": "completed"},
        {"collective_seq_id": 7, "profiling_name": "nccl:all_gather", "state": "scheduled"}])
    report = diagnose(tmp_path)
    line = next(x for x in report["lines"] if x.startswith("flight recorder"))
    assert "rank 1" in line and "2 recorded collectives" in line and "nccl:all_gather #7 in state scheduled" in line


def test_a_dump_alone_still_gives_a_report(tmp_path):
    _dump(flight_dir(tmp_path) / "hccl_trace_rank_3", [{"collective_seq_id": 2, "profiling_name": "hccl:broadcast",
                                                          "state": "started"}])
    report = diagnose(tmp_path)
    assert report is not None and report["flight"][0]["rank"] == 3


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_dump_that_would_run_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = flight_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "nccl_trace_rank_0").write_bytes(pickle.dumps({"entries": [_Evil()]}))
    report = diagnose(tmp_path)
    assert not (tmp_path / "pwned").exists()
    assert any("unreadable" in x and "not allowed" in x for x in report["lines"])


def test_the_worker_points_the_recorder_at_the_run_directory(tmp_path, monkeypatch):
    """train/worker.py sets the variable before the backend (and its launch env) is started."""
    from chipset.train import rank, worker
    from chipset.train.config import load_config, to_toml

    class Started(Exception):
        pass

    seen = {}

    def start(*_a, **_k):
        seen["dir"] = os.environ.get(FLIGHT_RECORDER_ENV)
        raise Started

    monkeypatch.delenv(FLIGHT_RECORDER_ENV, raising=False)
    monkeypatch.setattr(rank, "start", start)
    monkeypatch.setattr("chipset.train.signals.install", lambda: None)  # no handlers in the test process
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(to_toml(load_config(None)))
    with pytest.raises(Started):
        worker.run_rank(str(cfg_file), str(tmp_path / "run"))
    assert seen["dir"] == str(flight_dir(tmp_path / "run"))
