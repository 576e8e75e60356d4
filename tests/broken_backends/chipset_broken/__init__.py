"""Deliberately broken chipset backends, one entry point each, to prove the conformance suite fails them.

Every backend here is the CPU simulator with exactly one defect:

- ``bad_allreduce``: all_reduce drops the last rank's contribution (it zeroes its input first).
- ``bad_memory``: memory stats under-count allocated bytes by half.
- ``bad_kernel``: registers a swiglu whose float32 output is off by 1e-3 relative.
- ``bad_event``: events report negative elapsed time.
- ``bad_probe``: probe() initialises the device (and its descriptor says so, as a real one would).
- ``few_caps``: correct, but declares far fewer capabilities (the suite must skip, not fail).

Importing this module imports no vendor SDK, like any descriptor module.
"""

from __future__ import annotations

from chipset.discovery.descriptor import BackendDescriptor

VARIANTS = ("bad_allreduce", "bad_memory", "bad_kernel", "bad_event", "bad_probe", "few_caps")
_initialised: set[str] = set()


def _make(variant: str) -> BackendDescriptor:
    def probe():
        if variant == "bad_probe":
            # A real broken plugin would call e.g. its runtime's set_device() here.
            from chipset_broken import hooks

            hooks.initialise_device(variant)
            _initialised.add(variant)
        return True, f"{variant}: simulated, broken on purpose"

    def load():
        from chipset_broken import hooks

        return hooks.Plugin(variant)

    return BackendDescriptor(
        name=variant, api_version=(1, 0), priority=-10, probe=probe, load=load, simulator=True,
        description=f"deliberately broken backend ({variant})",
        device_initialized=lambda: variant in _initialised,
    )


bad_allreduce = _make("bad_allreduce")
bad_memory = _make("bad_memory")
bad_kernel = _make("bad_kernel")
bad_event = _make("bad_event")
bad_probe = _make("bad_probe")
few_caps = _make("few_caps")
