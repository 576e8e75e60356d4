"""The broken backends' implementations: cpu_sim's classes with one defect each.

Each defect is switched on by the variant's name; everything else is the simulator.
"""

from __future__ import annotations

import contextlib
import os

import torch

from chipset.discovery.spec import BackendSpec
from chipset.errors import CollectiveTimeoutError, DeviceIndexError
from chipset.interfaces import ALL_COLLECTIVES, Capabilities, Handle, MemoryStats
from chipset.interfaces.streams import SerialEvent, SerialStream
from chipset_cpu_sim.collective import SimCollective
from chipset_cpu_sim.device import VISIBLE_ENV, SimDevice
from chipset_cpu_sim.memory import SimMemory


def initialise_device(variant: str) -> None:
    SimDevice()  # creating the device is this backend's "device init"


def _fp8_twice_the_scale(x, w, scaling="tensorwise"):
    """fp8_matmul whose x scale is twice the specified one: x's largest values saturate at the
    format's maximum. Gradients are the reference's (only the forward value is wrong)."""
    from chipset.kernels.fp8 import FORWARD_FORMAT, fp8_matmul, quantize

    x2 = x.reshape(-1, x.shape[-1])
    fmax = torch.finfo(FORWARD_FORMAT).max
    _, sa = quantize(x2, FORWARD_FORMAT, scaling, dim=1)
    qa = (x2.float() * 2 * sa).clamp(-fmax, fmax).to(FORWARD_FORMAT)
    qb, sb = quantize(w.t(), FORWARD_FORMAT, scaling, dim=0)
    bad = ((qa.float() / (2 * sa)) @ (qb.float() / sb)).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    ref = fp8_matmul(x, w, scaling)
    return ref + (bad - ref).detach()


class _NegativeEvent(SerialEvent):
    def elapsed_time(self, end) -> float:
        return -abs(super().elapsed_time(end)) - 1.0


class _ContextlessStream(SerialStream):
    def context(self):
        return contextlib.nullcontext(self)  # the stream never becomes current


class _Device(SimDevice):
    def __init__(self, variant: str):
        self.variant = variant
        saved = os.environ.pop(VISIBLE_ENV, None) if variant == "ignores_visible" else None
        try:
            super().__init__()  # ignores_visible: sees every physical device, whatever the variable says
        finally:
            if saved is not None:
                os.environ[VISIBLE_ENV] = saved
        self.backend_name = variant

    def event(self, enable_timing: bool = False):
        if self.variant == "bad_event":
            return _NegativeEvent(self, enable_timing)
        return super().event(enable_timing)

    def stream(self):
        if self.variant == "bad_stream":
            return _ContextlessStream(self, self.current_device())
        return super().stream()

    def set_device(self, index: int) -> None:
        try:
            super().set_device(index)
        except DeviceIndexError:
            if self.variant != "bad_device_index":
                raise  # bad_device_index: an out-of-range index is silently ignored

    @property
    def supported_dtypes(self):
        if self.variant == "few_caps":
            return (torch.float32,)
        return super().supported_dtypes


class _Memory(SimMemory):
    def __init__(self, device, variant: str):
        super().__init__(device)
        self.variant = variant

    def stats(self, index=None) -> MemoryStats:
        s = super().stats(index)
        if self.variant == "bad_memory":  # under-counts allocated bytes by half
            return MemoryStats(s.allocated // 2, s.reserved, s.active, s.peak_allocated // 2, s.peak_reserved, s.peak_active)
        return s

    def empty_cache(self) -> None:
        if self.variant != "empty_cache_noop":
            super().empty_cache()

    def reset_peak_stats(self, index=None) -> None:
        if self.variant != "reset_peak_noop":
            super().reset_peak_stats(index)

    def mem_get_info(self, index=None):
        free, total = super().mem_get_info(index)
        return (free, 2 * total) if self.variant == "bad_mem_info" else (free, total)


class _NeverCompletes(Handle):
    def __init__(self, inner):
        self._inner = inner

    def wait(self) -> None:
        self._inner.wait()

    def is_completed(self) -> bool:
        return False


class _Collective(SimCollective):
    def __init__(self, device, variant: str):
        super().__init__(device)
        self.variant = variant
        self.backend_name = variant
        self._cache: dict = {}

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        v, g = self.variant, group or self.world
        if v == "bad_allreduce" and self.rank() == g.ranks[-1]:
            tensor.zero_()  # this rank's contribution never makes it into the sum
        if v == "stale_collective":  # replays the first result of the same op, shape and dtype
            key = (op, tuple(tensor.shape), tensor.dtype, g.name)
            if key in self._cache:
                tensor.copy_(self._cache[key])
                return None
            h = super().all_reduce(tensor, op, group, async_op)
            if h is not None:
                h.wait()
            self._cache[key] = tensor.clone()
            return None
        if v == "bf16_as_fp16" and tensor.dtype == torch.bfloat16:
            half = tensor.to(torch.float16)
            super().all_reduce(half, op, group)
            tensor.copy_(half)
            return None
        if v == "int64_as_int32" and tensor.dtype == torch.int64:
            narrow = tensor.to(torch.int32)
            super().all_reduce(narrow, op, group)
            tensor.copy_(narrow)
            return None
        if v == "bad_max" and op == "max":
            op = "sum"
        if v == "bad_avg" and op == "avg" and tensor.is_floating_point():
            op = "sum"  # forgets to divide by the group size
        if v == "swallow_timeout":
            try:
                return super().all_reduce(tensor, op, group, async_op)
            except CollectiveTimeoutError:
                return None  # the error is logged nowhere and the caller goes on
        return super().all_reduce(tensor, op, group, async_op)

    def new_group(self, ranks, name=""):
        if self.variant != "hang_timeout":
            return super().new_group(ranks, name)
        saved = os.environ.get("CHIPSET_COLLECTIVE_TIMEOUT")
        os.environ["CHIPSET_COLLECTIVE_TIMEOUT"] = "600"  # ignores the caller's timeout
        try:
            return super().new_group(ranks, name)
        finally:
            if saved is None:
                os.environ.pop("CHIPSET_COLLECTIVE_TIMEOUT", None)
            else:
                os.environ["CHIPSET_COLLECTIVE_TIMEOUT"] = saved

    def all_gather(self, output, input, group=None, async_op=False):
        h = super().all_gather(output, input, group, async_op)
        if self.variant == "bad_allgather":
            w = (group or self.world).size
            output.copy_(torch.cat(list(output.chunk(w))[::-1]))  # rank blocks in reverse order
        return h

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if self.variant == "bad_reduce_scatter":
            full = input.clone()
            super().all_reduce(full, op, group)
            w, r = (group or self.world).size, self.rank(group)
            output.copy_(full.chunk(w)[(r + 1) % w])  # the neighbour's block
            return None
        return super().reduce_scatter(output, input, op, group, async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        if self.variant == "bad_broadcast":
            src = (group or self.world).ranks[0]  # always broadcasts from the first rank
        return super().broadcast(tensor, src, group, async_op)

    def all_to_all(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if self.variant != "no_output_splits" or output_split_sizes is None:
            return super().all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)
        # Receives correctly, then lays the blocks out at the offsets of the INPUT splits.
        tmp = torch.empty_like(output)
        super().all_to_all(tmp, input, output_split_sizes, input_split_sizes, group)
        offset = 0
        for piece, size in zip(tmp.split(list(output_split_sizes)), input_split_sizes, strict=True):
            n = max(0, min(piece.numel(), output.numel() - offset))
            output[offset:offset + n] = piece[:n]
            offset += size
        return None

    def recv(self, tensor, src, group=None):
        super().recv(tensor, src, group)
        if self.variant == "bad_send_recv":
            tensor[-1:] = 0  # drops the message's last element

    def barrier(self, group=None):
        if self.variant != "bad_barrier":
            super().barrier(group)

    def _run(self, op, group, tensors, fn, async_op, raw=False):
        h = super()._run(op, group, tensors, fn, async_op, raw)
        if self.variant == "async_never_completes" and isinstance(h, Handle):
            return _NeverCompletes(h)
        return h


def _capabilities(variant: str) -> Capabilities:
    if variant == "few_caps":
        return Capabilities(
            dtypes=("float32",), amp_dtypes=(), collectives=("all_reduce", "barrier"),
            collective_dtypes=("float32",), streams=False, event_timing=False,
            memory_capacity_enforced=False, multi_process=True,
        )
    return Capabilities(
        dtypes=("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"),
        amp_dtypes=("bfloat16", "float16"), collectives=ALL_COLLECTIVES,
        collective_dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
        streams=True, event_timing=True, memory_capacity_enforced=True, multi_process=True,
        fp8=("tensorwise", "rowwise"),
    )


def _register_kernels(v: str, registry) -> None:
    if v == "bad_kernel":
        ref = registry.reference("swiglu")

        def swiglu(gate, up):
            out = ref(gate, up)
            return out * (1 + 1e-3) if out.dtype == torch.float32 else out

        registry.register("swiglu", swiglu, priority=5, description="swiglu, off by 1e-3 in float32")
    elif v == "ignores_eps":
        ref = registry.reference("rms_norm")
        registry.register("rms_norm", lambda x, weight, eps=1e-6: ref(x, weight), priority=5,
                          description="rms_norm that always uses eps=1e-6")
    elif v == "ignores_mask":
        ref = registry.reference("scaled_dot_product_attention")
        registry.register(
            "scaled_dot_product_attention",
            lambda q, k, v, mask=None, causal=False, scale=None: ref(q, k, v, None, causal, scale),
            priority=5, description="attention that drops the mask")
    elif v == "bad_grouped_mm":
        ref = registry.reference("grouped_mm")
        registry.register("grouped_mm", lambda x, w, offs: ref(x, w[:1].expand_as(w), offs), priority=5,
                          description="grouped_mm with the first group's weights for every group")
    elif v == "bad_grouped_mlp":
        ref = registry.reference("grouped_mlp")
        registry.register("grouped_mlp", lambda x, w_gate, w_up, w_down, offs: ref(x, w_up, w_gate, w_down, offs),
                          priority=5, description="grouped_mlp with the gate and up projections swapped")
    elif v == "bad_fp8_scale":
        registry.register("fp8_matmul", _fp8_twice_the_scale, priority=5,
                          description="fp8_matmul with twice the specified scale for x")
    elif v == "bad_linear":
        ref = registry.reference("linear")
        registry.register("linear", lambda x, weight, bias=None: ref(x, weight), priority=5,
                          description="linear that drops the bias")
    elif v == "ignores_ignore_index":
        ref = registry.reference("cross_entropy")
        registry.register(
            "cross_entropy",
            lambda logits, target, ignore_index=-100, reduction="mean": ref(logits, target, -100, reduction),
            priority=5, description="cross_entropy that only knows ignore_index=-100")


def spec(variant: str) -> BackendSpec:
    """The backend spec of one variant."""
    return BackendSpec(
        name=variant,
        device=lambda: _Device(variant),
        memory=lambda device: _Memory(device, variant),
        collective=lambda device: _Collective(device, variant),
        capabilities=_capabilities(variant),
        register_kernels=lambda registry, device: _register_kernels(variant, registry),
    )
