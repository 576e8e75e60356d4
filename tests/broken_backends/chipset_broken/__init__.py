"""Deliberately broken chipset backends, one entry point each, to prove the conformance suite fails them.

Every backend here is the CPU simulator with exactly one defect (see ``DEFECTS``); each
is failed by a named conformance check (tests/conformance/test_conformance_selftest.py), except
``few_caps``, correct but declaring fewer capabilities (the suite must skip, not fail).

Importing this module imports no vendor SDK, like any descriptor module.
"""

from __future__ import annotations

from chipset.discovery.descriptor import BackendDescriptor

DEFECTS = {
    "bad_allreduce": "all_reduce drops the last rank's contribution",
    "stale_collective": "all_reduce replays the first result of the same op, shape and dtype",
    "bf16_as_fp16": "bfloat16 all_reduce computed in float16",
    "int64_as_int32": "int64 all_reduce carried as int32",
    "bad_max": "all_reduce max computed as a sum",
    "bad_avg": "float all_reduce avg not divided by the group size",
    "bad_allgather": "all_gather lays the rank blocks out in reverse order",
    "bad_reduce_scatter": "reduce_scatter returns the neighbour's block",
    "bad_broadcast": "broadcast always sends from the group's first rank",
    "no_output_splits": "uneven all_to_all lays its output out by the input split sizes",
    "bad_send_recv": "recv drops the message's last element",
    "bad_barrier": "barrier returns without waiting",
    "async_never_completes": "async handles never report completion",
    "hang_timeout": "new_group ignores CHIPSET_COLLECTIVE_TIMEOUT (a dead peer hangs)",
    "swallow_timeout": "all_reduce swallows CollectiveTimeoutError and returns",
    "bad_memory": "memory stats under-count allocated bytes by half",
    "empty_cache_noop": "empty_cache does nothing",
    "reset_peak_noop": "reset_peak_stats does nothing",
    "bad_mem_info": "mem_get_info reports twice the device's total memory",
    "bad_kernel": "swiglu off by 1e-3 relative in float32",
    "ignores_eps": "rms_norm ignores eps",
    "ignores_mask": "scaled_dot_product_attention drops the mask",
    "ignores_ignore_index": "cross_entropy only honours ignore_index=-100",
    "bad_grouped_mm": "grouped_mm multiplies every group by the first group's weights",
    "bad_grouped_mlp": "grouped_mlp swaps the experts' gate and up projections",
    "bad_fp8_scale": "fp8_matmul quantises x with twice its specified scale (its largest values saturate)",
    "bad_linear": "linear drops the bias",
    "bad_event": "events report negative elapsed time",
    "bad_stream": "Stream.context does not make the stream current",
    "bad_probe": "probe() initialises the device",
    "ignores_visible": "the device count ignores the visible-devices variable",
    "bad_device_index": "set_device silently accepts an out-of-range index",
    "wrong_profile": "declares a profile for its device with twice the device's bf16 peak",
}
"""Each broken backend and its one defect."""

VARIANTS = (
    "bad_allreduce", "stale_collective", "bf16_as_fp16", "int64_as_int32", "bad_max", "bad_avg", "bad_allgather",
    "bad_reduce_scatter", "bad_broadcast", "no_output_splits", "bad_send_recv", "bad_barrier",
    "async_never_completes", "hang_timeout", "swallow_timeout", "bad_memory", "empty_cache_noop",
    "reset_peak_noop", "bad_mem_info", "bad_kernel", "ignores_eps", "ignores_mask", "ignores_ignore_index",
    "bad_grouped_mm", "bad_grouped_mlp", "bad_fp8_scale", "bad_linear",
    "bad_event", "bad_stream", "bad_probe", "ignores_visible", "bad_device_index", "wrong_profile", "few_caps",
)
_initialised: set[str] = set()


def _make(variant: str) -> BackendDescriptor:
    def probe():
        if variant == "bad_probe":
            # A real broken plugin would call e.g. its runtime's set_device() here.
            from chipset_broken import backend

            backend.initialise_device(variant)
            _initialised.add(variant)
        return True, f"{variant}: simulated, broken on purpose"

    def load():
        from chipset_broken import backend

        return backend.spec(variant)

    def profiles():
        # Keyed apart from the simulator's own "sim-generic" (profile names are global), named
        # like the device, as a vendor keys "h200" for a device reporting "NVIDIA H200".
        import dataclasses

        from chipset_cpu_sim.profiles import descriptor_profiles

        real = descriptor_profiles()["sim-generic"]
        rates = {**real.peak_flops, "bfloat16": 2 * real.peak_flops["bfloat16"]}
        return {"broken-generic": dataclasses.replace(real, peak_flops=rates)}

    return BackendDescriptor(
        name=variant, api_version=(1, 1), priority=-10, probe=probe, load=load, simulator=True,
        description=f"deliberately broken backend ({variant})",
        device_initialized=lambda: variant in _initialised,
        profiles=profiles if variant == "wrong_profile" else None,
    )


for _v in VARIANTS:
    globals()[_v] = _make(_v)  # the entry points name these module attributes
