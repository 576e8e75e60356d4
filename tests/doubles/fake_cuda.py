"""Test doubles of ``torch`` / ``torch.cuda`` for chipset-cuda on a machine without a GPU.

``FakeTorchForProbe`` stands in for the ``torch`` module the probe receives: it answers
only the calls a fork-safe probe may make (``version.cuda``, NVML device counts,
``is_available`` under ``PYTORCH_NVML_BASED_CUDA_CHECK``) and fails the test on any
other ``torch.cuda`` attribute, since those may create a CUDA context.

``FakeCuda`` stands in for ``torch.cuda`` behind ``CudaDevice``/``CudaMemory``: a few
GPUs with fixed properties, caching-allocator statistics and RNG states in memory.
Nothing here is a GPU; it checks the plugin's mapping logic, not CUDA.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import torch


class ProbeTouchedCuda(AssertionError):
    """The probe used a torch.cuda API that may initialise CUDA."""


class _ProbeCuda:
    _ALLOWED = {"_raw_device_count_nvml", "is_available"}

    def __init__(self, present: int, visible: int | None):
        self._present = present
        self._visible = (0 if present == "oserror" else present) if visible is None else visible
        self.nvml_flag_seen: list[str | None] = []

    def _raw_device_count_nvml(self) -> int:
        if self._present == "oserror":  # torch 2.8's answer on a machine without libnvidia-ml.so
            raise OSError("libnvidia-ml.so.1: cannot open shared object file: No such file or directory")
        return self._present

    def is_available(self) -> bool:
        # torch reads PYTORCH_NVML_BASED_CUDA_CHECK at call time; record what it saw.
        flag = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
        self.nvml_flag_seen.append(flag)
        if flag != "1":
            raise ProbeTouchedCuda("is_available() without PYTORCH_NVML_BASED_CUDA_CHECK=1 initialises CUDA")
        return self._present != "oserror" and self._present > 0 and self._visible > 0

    def __getattr__(self, name):
        raise ProbeTouchedCuda(f"the probe used torch.cuda.{name}, which may initialise CUDA")


class FakeTorchForProbe:
    """A ``torch`` double for ``chipset_cuda._probe``.

    ``cuda_version=None`` is a CPU-only build; ``present`` is NVML's raw count (-1 = no
    driver; ``"oserror"``: NVML's library is missing and the call raises, as torch 2.8 does); ``visible`` is what is left after CUDA_VISIBLE_DEVICES (default: all).
    """

    def __init__(self, cuda_version: str | None = "12.8", present: int = 1, visible: int | None = None):
        self.__version__ = "2.13.0+fake"
        self.version = SimpleNamespace(cuda=cuda_version)
        self.cuda = _ProbeCuda(present, visible)


class _FakeStream:
    """Like ``torch.cuda.Stream``: ``torch.cuda.current_stream()`` hands out a fresh Python
    object per call, equal (and hashing equal) to every other object of the same stream."""

    _ids = iter(range(1, 1 << 30))

    def __init__(self, stream_id: int | None = None):
        self.stream_id = next(self._ids) if stream_id is None else stream_id
        self.synchronized = 0
        self.waited_events: list = []
        self.waited_streams: list = []

    def synchronize(self):
        self.synchronized += 1

    def wait_event(self, event):
        self.waited_events.append(event)

    def wait_stream(self, other):
        self.waited_streams.append(other)

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _FakeStream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(self.stream_id)


class _FakeEvent:
    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing
        self.recorded_on = "unrecorded"

    def record(self, stream=None):
        self.recorded_on = stream

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        # torch 2.11 on an H200 raised ValueError for both (older torch: RuntimeError).
        if not (self.enable_timing and end.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if "unrecorded" in (self.recorded_on, end.recorded_on):
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return 1.5


class FakeCuda:
    """A ``torch.cuda`` double with ``len(gpus)`` devices.

    ``gpus``: (name, total_memory_bytes, (major, minor), sm_count) per visible GPU.
    """

    H100 = ("NVIDIA H100 80GB HBM3", 85_520_809_984, (9, 0), 132)

    def __init__(self, gpus=(H100,)):
        self._gpus = list(gpus)
        self._current = 0
        self.stats = [dict() for _ in self._gpus]
        self.free = [g[1] for g in self._gpus]
        self.rng = [torch.zeros(16, dtype=torch.uint8) for _ in self._gpus]
        self.calls: list[tuple] = []
        self.Stream = _FakeStream
        self.Event = _FakeEvent
        self._current_stream = _FakeStream()

    def device_count(self):
        return len(self._gpus)

    def set_device(self, i):
        self.calls.append(("set_device", i))
        self._current = i

    def current_device(self):
        return self._current

    def synchronize(self, i=None):
        self.calls.append(("synchronize", i))

    def get_device_properties(self, i):
        name, mem, (major, minor), sms = self._gpus[i]
        return SimpleNamespace(name=name, total_memory=mem, major=major, minor=minor, multi_processor_count=sms)

    def get_device_capability(self, i=None):
        return self._gpus[self._current if i is None else i][2]

    def memory_stats(self, i):
        return dict(self.stats[i])

    def reset_peak_memory_stats(self, i):
        self.calls.append(("reset_peak_memory_stats", i))
        for key in list(self.stats[i]):
            if key.endswith(".peak"):
                self.stats[i][key] = self.stats[i][key.replace(".peak", ".current")]

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def mem_get_info(self, i):
        return self.free[i], self._gpus[i][1]

    def manual_seed(self, seed):
        self.rng[self._current] = torch.full((16,), seed % 256, dtype=torch.uint8)

    def manual_seed_all(self, seed):
        self.rng = [torch.full((16,), seed % 256, dtype=torch.uint8) for _ in self._gpus]

    def get_rng_state(self, i):
        return self.rng[i].clone()

    def set_rng_state(self, state, i):
        self.rng[i] = state.clone()

    def current_stream(self):
        return _FakeStream(self._current_stream.stream_id)  # a fresh object, as torch.cuda does

    @contextlib.contextmanager
    def stream(self, s):
        old, self._current_stream = self._current_stream, s
        try:
            yield
        finally:
            self._current_stream = old
