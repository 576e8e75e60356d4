"""chipset-cuda's Device, Memory, Collective, capabilities and spec, without a GPU.

Device and Memory are driven through ``FakeCuda``, a named test double of ``torch.cuda``
(tests/doubles/fake_cuda.py); OOM translation uses real ``torch.OutOfMemoryError``s with
the caching allocator's message formats. What needs a real GPU is in plugins/cuda/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch
from doubles.fake_cuda import FakeCuda

import chipset
from chipset.errors import BackendUnavailableError, CollectiveError, DeviceIndexError
from chipset.interfaces import Collective
from chipset.kernels import KernelRegistry
from chipset_cuda import backend
from chipset_cuda.collective import CudaCollective
from chipset_cuda.device import CudaDevice
from chipset_cuda.memory import CudaMemory

GiB = 2**30
V100 = ("Tesla V100-SXM2-16GB", 16 * GiB, (7, 0), 80)
A100 = ("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0), 108)

# The caching allocator's messages (c10/cuda/CUDACachingAllocator.cpp), new and old format.
OOM_NEW = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB of which "
    "1.23 GiB is free. Including non-PyTorch memory, this process has 77.86 GiB memory in use. Of the "
    "allocated memory 76.50 GiB is allocated by PyTorch, and 650.00 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
OOM_OLD = (
    "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already "
    "allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)"
)


@pytest.fixture
def fake():
    return FakeCuda(gpus=[FakeCuda.H100, FakeCuda.H100])


@pytest.fixture
def device(fake):
    return CudaDevice(cuda=fake)


# --- Device --------------------------------------------------------------------------
def test_device_counts_and_binds_through_torch_cuda(device, fake):
    assert device.device_count() == 2 and device.device_type == "cuda"
    device.set_device(1)
    assert device.current_device() == 1 and ("set_device", 1) in fake.calls
    assert device.torch_device() == torch.device("cuda", 1)
    device.synchronize(0)
    assert ("synchronize", 0) in fake.calls


def test_out_of_range_index_names_cuda_visible_devices(device):
    with pytest.raises(DeviceIndexError, match=r"2 device\(s\) visible.*CUDA_VISIBLE_DEVICES"):
        device.set_device(2)


def test_no_visible_gpu_is_a_clear_unavailable_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(BackendUnavailableError, match="CUDA_VISIBLE_DEVICES='5'"):
        CudaDevice(cuda=FakeCuda(gpus=[]))


def test_properties_come_from_the_table_with_measured_memory(device):
    p = device.properties(1)
    assert p.name == "NVIDIA H100 80GB HBM3" and p.index == 1
    assert p.total_memory == FakeCuda.H100[1] and p.compute_capability == (9, 0)
    assert p.peak_flops_for(torch.bfloat16) == pytest.approx(989.4e12) and not p.estimated


def test_unknown_gpu_properties_are_labelled_estimates():
    p = CudaDevice(cuda=FakeCuda(gpus=[("NVIDIA Future X1", 96 * GiB, (11, 0), 160)])).properties(0)
    assert p.estimated and p.source.startswith("ESTIMATE")


@pytest.mark.parametrize(
    ("gpus", "bf16", "fp8"),
    [([V100], False, False), ([A100], True, False), ([FakeCuda.H100], True, True), ([FakeCuda.H100, V100], False, False)],
)
def test_dtypes_and_capabilities_follow_the_lowest_compute_capability(gpus, bf16, fp8):
    device = CudaDevice(cuda=FakeCuda(gpus=gpus))
    caps = backend.spec.capabilities(device)
    assert (torch.bfloat16 in device.supported_dtypes) == bf16 == caps.has_dtype("bfloat16")
    assert ("bfloat16" in caps.amp_dtypes) == bf16 and ("bfloat16" in caps.collective_dtypes) == bf16
    assert (torch.float8_e4m3fn in device.supported_dtypes) == fp8 == caps.has_dtype("float8_e4m3fn")
    assert caps.graph_capture and caps.event_timing and caps.streams and caps.pinned_memory


def test_rng_state_is_per_device(device):
    device.manual_seed_all(3)
    device.set_device(1)
    device.manual_seed(9)
    assert device.get_rng_state(0)[0] == 3 and device.get_rng_state(1)[0] == 9
    device.set_rng_state(torch.full((16,), 4, dtype=torch.uint8), 0)
    assert device.get_rng_state(0)[0] == 4


def test_streams_and_events_wrap_torch_cuda_objects(device, fake):
    s = device.stream()
    e = device.event(enable_timing=True)
    s.record_event(e)
    assert e.torch_event.recorded_on is s.torch_stream
    s.wait_event(e)
    assert s.torch_stream.waited_events == [e.torch_event]
    before = device.current_stream()
    assert device.current_stream() is before  # one wrapper per stream, though torch.cuda hands out fresh objects
    with s.context():
        assert fake.current_stream() == s.torch_stream
        assert device.current_stream() is s
    assert device.current_stream() is before
    end = device.event(enable_timing=True)
    end.record()
    assert e.elapsed_time(end) == 1.5
    # The interface's RuntimeError, whatever torch raises (2.11 raises ValueError).
    with pytest.raises(RuntimeError, match="enable_timing"):
        device.event().elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded"):
        device.event(enable_timing=True).elapsed_time(end)


# --- Memory --------------------------------------------------------------------------
def test_caching_allocator_statistics_map_onto_memory_stats(device, fake):
    fake.stats[1] = {
        "allocated_bytes.all.current": 100, "allocated_bytes.all.peak": 400,
        "reserved_bytes.all.current": 2048, "reserved_bytes.all.peak": 4096,
        "active_bytes.all.current": 512, "active_bytes.all.peak": 1024,
    }
    mem = CudaMemory(device, cuda=fake)
    assert mem.stats(1) == chipset.MemoryStats(100, 2048, 512, 400, 4096, 1024)
    mem.reset_peak_stats(1)
    assert mem.stats(1).peak_allocated == 100
    assert mem.stats(0) == chipset.MemoryStats()  # a fresh GPU reports an empty dict
    assert mem.mem_get_info(1) == (FakeCuda.H100[1], FakeCuda.H100[1])


@pytest.mark.parametrize(("message", "requested", "where"), [(OOM_NEW, 2 * GiB, "cuda:1"), (OOM_OLD, 36 * 2**20, "cuda:0")])
def test_cuda_oom_becomes_chipset_oom_with_bytes_and_device(device, message, requested, where):
    err = CudaMemory(device).translate_oom(torch.OutOfMemoryError(message))
    assert isinstance(err, chipset.OutOfMemoryError)
    assert f"Tried to allocate {requested} bytes" in str(err)
    assert err.requested_bytes == requested and err.device == where and f"device {where}" in str(err)


def test_oom_guard_reraises_cuda_oom_as_chipset_oom_and_passes_other_errors(device):
    mem = CudaMemory(device)
    with pytest.raises(chipset.OutOfMemoryError) as info, mem.oom_guard("cuda:0"):
        raise torch.OutOfMemoryError(OOM_NEW)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError) and info.value.device == "cuda:0"
    with pytest.raises(ValueError), mem.oom_guard("cuda:0"):
        raise ValueError("not memory")


def test_cublas_allocation_failure_counts_as_oom(device):
    err = CudaMemory(device).translate_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert isinstance(err, chipset.OutOfMemoryError) and "unknown number of bytes" in str(err)


# --- Collective ----------------------------------------------------------------------
def test_collective_uses_nccl_and_translates_errors(device):
    coll = CudaCollective(device)
    assert isinstance(coll, Collective) and coll.c10d_backend == "nccl"
    oom = coll._translate(torch.OutOfMemoryError(OOM_NEW), "all_reduce on world (8 ranks)")
    assert isinstance(oom, chipset.OutOfMemoryError) and oom.device == "cuda:1"
    broken = coll._translate(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), "all_reduce on world (8 ranks)")
    assert isinstance(broken, CollectiveError) and "all_reduce on world" in str(broken)


# --- the spec ------------------------------------------------------------------------
def test_descriptor_loads_the_cuda_spec():
    import chipset_cuda

    spec = chipset_cuda.descriptor.load()
    assert spec is backend.spec and spec.name == "cuda"
    assert (spec.device, spec.memory, spec.collective) == (CudaDevice, CudaMemory, CudaCollective)


def test_launch_env_orders_gpus_like_nvidia_smi_and_passes_visibility_on(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    env = backend.spec.launch_env(1, 2)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_kernels_register_with_predicates_that_reject_cpu_tensors(device, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reg = KernelRegistry("cuda")
    backend.spec.register_kernels(reg, device)
    registered = {n for n in reg.names() if reg.implementations(n)}
    assert {"scaled_dot_product_attention", "fused_adamw", "grouped_mm"} <= registered
    from chipset_cuda.kernels import triton_importable

    if triton_importable():
        assert {"rms_norm", "rotary_embedding", "swiglu", "cross_entropy"} <= registered
    x, w = torch.randn(2, 8), torch.ones(8)
    # CPU tensors are not CUDA tensors: dispatch falls back to the core reference.
    assert reg.select("rms_norm", x, w) is reg.reference("rms_norm")
    q = torch.randn(1, 2, 4, 8)
    assert reg.select("scaled_dot_product_attention", q, q, q) is reg.reference("scaled_dot_product_attention")
    x, w = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
    assert reg.select("grouped_mm", x, w, torch.tensor([8, 16], dtype=torch.int32)) is reg.reference("grouped_mm")
    # What the predicate asks a GPU once: a tiny padded bfloat16 call, forward and backward, right.
    # torch runs the op on the CPU too (a matmul per group), so the call's own checks run here.
    from chipset_cuda.kernels import grouped_mm_runs

    assert grouped_mm_runs(torch.device("cpu")) == hasattr(torch, "_grouped_mm")


def test_grouped_mm_probe_runs_once_untraced_and_with_gradients_whatever_the_caller(monkeypatch):
    """The first MoE layer to ask whether a GPU runs the grouped kernel may be inside torch.compile's
    tracing, or under no_grad or inference_mode: the probe (real work, forward and backward) still
    runs once, for real, and its answer holds (here on the CPU, where torch runs the op too)."""
    from chipset_cuda import kernels

    kernels.device_runs_grouped_mm.forget()  # as in a fresh process: not asked yet
    asked, probe = [], kernels.grouped_mm_runs
    monkeypatch.setattr(kernels, "grouped_mm_runs", lambda dev: asked.append(dev) or probe(dev))

    def layer(x):
        return x * 2 if kernels.device_runs_grouped_mm(x.device) else x - 1

    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # a graph break fails here
    with torch.no_grad():
        outs = [compiled(torch.ones(2)) for _ in range(3)]
    expected = 2.0 if hasattr(torch, "_grouped_mm") else 0.0
    assert all(out.eq(expected).all() for out in outs)
    assert asked == [torch.device("cpu")]
    kernels.device_runs_grouped_mm.forget()
    with torch.inference_mode():
        assert kernels.device_runs_grouped_mm(torch.device("cpu")) == hasattr(torch, "_grouped_mm")
    kernels.device_runs_grouped_mm.forget()
