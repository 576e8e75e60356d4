"""The Ascend backend loaded through chipset's real discovery and loader, against the torch_npu TEST DOUBLE."""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from chipset.errors import CollectiveTimeoutError, ConfigError, DeviceIndexError, OutOfMemoryError

_spec = importlib.util.spec_from_file_location("torch_npu_double_install", Path(__file__).parents[1] / "doubles" / "torch_npu_double" / "install.py")
double = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(double)


@pytest.fixture
def npu_double(monkeypatch, tmp_path):
    yield double.install(monkeypatch, tmp_path)
    double.purge_modules()


def load_ascend():
    from chipset.discovery.records import discover
    from chipset.discovery.select import select
    from chipset.loader import load_backend

    records = discover(refresh=True)
    b = load_backend(select("ascend", records), records)
    b.device.device_type = "cpu"  # the double keeps tensors on the host
    return b


def test_loads_through_discovery_with_hccl_and_npu(npu_double):
    b = load_ascend()
    assert b.name == "ascend"
    assert type(b.device).device_type == "npu"
    assert b.collective.c10d_backend == "hccl"
    assert b.device.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert b.device.start_method == "spawn"
    assert set(b.capabilities.kernels) == {"rms_norm", "rotary_embedding", "scaled_dot_product_attention", "swiglu", "fused_adamw"}
    assert "float64" not in b.capabilities.dtypes and "bfloat16" in b.capabilities.amp_dtypes


def test_visible_devices_are_honoured(npu_double, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,5")
    b = load_ascend()
    assert b.device.device_count() == 2
    b.device.set_device(1)
    assert b.device.current_device() == 1
    with pytest.raises(DeviceIndexError, match="ASCEND_RT_VISIBLE_DEVICES"):
        b.device.set_device(2)


def test_properties_come_from_the_runtime_and_the_910b_profile(npu_double):
    p = load_ascend().device.properties(0)
    assert p.name == "Ascend910B3"
    assert p.total_memory == npu_double.npu.get_device_properties(0).total_memory  # the runtime's, not the HBM size
    assert p.peak_flops_for(torch.bfloat16) == 313e12 and p.estimated
    assert p.multiprocessor_count == 20


def test_unknown_soc_reports_memory_but_no_rates(monkeypatch, tmp_path):
    double.install(monkeypatch, tmp_path, soc="Ascend910A")
    try:
        b = load_ascend()
        p = b.device.properties(0)
        assert p.peak_flops == {} and p.total_memory > 0 and "no chipset profile" in p.source
        # The 910A has no bfloat16: neither the capabilities nor the device claim it.
        assert "bfloat16" not in b.capabilities.dtypes and torch.bfloat16 not in b.device.supported_dtypes
    finally:
        double.purge_modules()


def test_memory_stats_map_torch_npu_allocator_statistics(npu_double):
    mem = load_ascend().memory
    assert mem.stats().allocated == 0  # an allocator that never allocated returns {}
    npu_double._double.allocate(3 << 20)
    npu_double._double.allocate(1 << 20)
    npu_double._double.free(3 << 20)
    s = mem.stats()
    assert (s.allocated, s.reserved, s.active) == (1 << 20, 4 << 20, 1 << 20)
    assert (s.peak_allocated, s.peak_reserved) == (4 << 20, 4 << 20)
    mem.reset_peak_stats()
    assert mem.stats().peak_allocated == 1 << 20
    mem.empty_cache()
    assert mem.stats().reserved == 1 << 20
    free, total = mem.mem_get_info()
    assert total - free == 1 << 20 and mem.total_memory() == total


@pytest.mark.parametrize("kind", ["torch.OutOfMemoryError", "runtime"])
def test_torch_npu_oom_becomes_chipset_oom(npu_double, monkeypatch, kind):
    if kind == "runtime":
        monkeypatch.setenv("TORCH_NPU_DOUBLE_OOM", "runtime")  # older torch_npu: a plain RuntimeError
    b = load_ascend()
    b.device.set_device(3)
    with pytest.raises(OutOfMemoryError) as info, b.memory.oom_guard():
        npu_double._double.allocate(80 << 30)
    err = info.value
    assert err.requested_bytes == 80 << 30
    assert err.device == "npu:3"
    assert f"Tried to allocate {80 << 30} bytes" in str(err) and "npu:3" in str(err)
    assert isinstance(err.__cause__, RuntimeError)


def test_other_errors_are_not_ooms(npu_double):
    mem = load_ascend().memory
    assert mem.translate_oom(RuntimeError("HCCL function error")) is None


def test_hf32_is_switched_off_for_conformance_by_default(npu_double):
    # torch_npu's defaults are matmul off, conv on; chipset turns both off so fp32 is fp32.
    assert npu_double.npu.conv.allow_hf32 is True
    b = load_ascend()
    assert npu_double.npu.matmul.allow_hf32 is False and npu_double.npu.conv.allow_hf32 is False
    assert "float32" not in b.capabilities.tolerances


def test_hf32_opt_in_declares_a_looser_fp32_tolerance(npu_double, monkeypatch):
    monkeypatch.setenv("CHIPSET_ASCEND_ALLOW_HF32", "1")
    b = load_ascend()
    assert npu_double.npu.matmul.allow_hf32 is True and npu_double.npu.conv.allow_hf32 is True
    rtol, atol = b.capabilities.tolerances["float32"]
    assert rtol > 1.3e-6 and atol > 1e-5


def test_hf32_setting_must_be_a_boolean(npu_double, monkeypatch):
    monkeypatch.setenv("CHIPSET_ASCEND_ALLOW_HF32", "maybe")
    with pytest.raises(ConfigError, match="CHIPSET_ASCEND_ALLOW_HF32"):
        load_ascend()


def test_rng_is_per_device_and_restorable(npu_double):
    dev = load_ascend().device
    dev.manual_seed(1234)
    assert torch.equal(dev.get_rng_state(), torch.Generator().manual_seed(1234).get_state())
    before = dev.get_rng_state(1)
    dev.manual_seed_all(7)
    assert not torch.equal(dev.get_rng_state(1), before)
    dev.set_rng_state(before, 1)
    assert torch.equal(dev.get_rng_state(1), before)


def test_streams_and_events(npu_double):
    dev = load_ascend().device
    s = dev.stream()
    start, end = dev.event(enable_timing=True), dev.event(enable_timing=True)
    start.record(s)
    with s.context():
        end.record()
    s.wait_event(end)
    s.wait_stream(dev.current_stream())
    assert end.query() and s.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        dev.event().elapsed_time(end)


@pytest.mark.parametrize(
    "chipset_timeout, connect, execute",
    [("30", "120", "30"), ("600", "600", "600"), ("9000", "7200", "9000"), ("0.5", "120", "1")],
)
def test_hccl_timeouts_follow_the_collective_timeout(npu_double, monkeypatch, chipset_timeout, connect, execute):
    monkeypatch.setenv("CHIPSET_COLLECTIVE_TIMEOUT", chipset_timeout)
    env = load_ascend().launch_env(local_rank=0, local_world_size=8)
    assert env["HCCL_CONNECT_TIMEOUT"] == connect and env["HCCL_EXEC_TIMEOUT"] == execute


def test_hccl_value_set_by_the_user_wins(npu_double, monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")
    env = load_ascend().launch_env(local_rank=0, local_world_size=1)
    assert "HCCL_EXEC_TIMEOUT" not in env and env["HCCL_CONNECT_TIMEOUT"] == "600"


def test_launch_env_refuses_more_ranks_than_visible_npus(npu_double, monkeypatch):
    b = load_ascend()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    assert b.launch_env(local_rank=1, local_world_size=2)["HCCL_EXEC_TIMEOUT"] == "600"
    with pytest.raises(ConfigError, match="ASCEND_RT_VISIBLE_DEVICES='0,1' makes 2 NPU"):
        b.launch_env(local_rank=0, local_world_size=4)


def test_init_process_group_sets_hccl_timeouts_before_init_and_runs_collectives(npu_double, monkeypatch):
    monkeypatch.setenv("CHIPSET_COLLECTIVE_TIMEOUT", "45")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    coll = load_ascend().collective
    coll.init_process_group(timeout=dt.timedelta(seconds=45))
    try:
        assert os.environ["HCCL_EXEC_TIMEOUT"] == "45" and os.environ["HCCL_CONNECT_TIMEOUT"] == "120"
        t = torch.ones(4)
        coll.all_reduce(t)
        assert torch.equal(t, torch.ones(4))
        assert torch.distributed.get_backend() == "hccl"
    finally:
        coll.destroy()
        for k in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"):
            os.environ.pop(k, None)


@pytest.mark.parametrize(
    "message",
    [
        "EI0002: The wait execution of the Notify register times out. Reason: ...",
        "EI0006: Getting socket times out. Reason: ...",
        "[Rank 1] Watchdog caught collective operation timeout: WorkHCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600123 milliseconds before timing out.",
    ],
)
def test_hccl_timeouts_become_collective_timeout_errors(npu_double, message):
    coll = load_ascend().collective
    err = coll._translate(RuntimeError(message), "all_reduce on world (8 ranks)")
    assert isinstance(err, CollectiveTimeoutError) and "CHIPSET_COLLECTIVE_TIMEOUT" in str(err)


class _DoneWork:
    def wait(self):
        return None

    def is_completed(self):
        return True


@pytest.mark.parametrize(
    "dtype, mine, theirs, want",
    [(torch.float32, [3.0, 5.0], [0.0, 1.0], [1.5, 3.0]), (torch.int64, [3, -5], [0, 0], [1, -2])],
)
def test_avg_is_a_sum_then_a_division_because_hccl_has_no_avg(npu_double, monkeypatch, dtype, mine, theirs, want):
    # torch_npu's ProcessGroupHCCL maps SUM/MAX/MIN/PRODUCT only: AVG must never reach it.
    import torch.distributed as dist

    from chipset.interfaces import Group

    coll = load_ascend().collective
    ops = []

    def two_rank_sum(t, op, group=None, async_op=False):
        ops.append(op)
        t.add_(torch.tensor(theirs, dtype=dtype))  # the other rank's contribution
        return _DoneWork() if async_op else None

    monkeypatch.setattr(dist, "all_reduce", two_rank_sum)
    monkeypatch.setattr(type(coll), "world", property(lambda self: Group((0, 1), None, "world")))
    for async_op in (False, True):
        t = torch.tensor(mine, dtype=dtype)
        h = coll.all_reduce(t, "avg", async_op=async_op)
        if async_op:
            h.wait()
            assert h.is_completed()
        assert torch.equal(t, torch.tensor(want, dtype=dtype))
    assert ops == [dist.ReduceOp.SUM, dist.ReduceOp.SUM]


def test_stream_context_makes_the_same_wrapper_current(npu_double):
    dev = load_ascend().device
    before = dev.current_stream()
    s = dev.stream()
    with s.context():
        assert dev.current_stream() is s
    assert dev.current_stream() is before and dev.current_stream() == before
