"""The conformance work plan's probe: what it lists, and what it leaves to the checks.

Probing binds a device (cpu_sim then counts every allocation of the process), so each
probe runs in a fresh interpreter, as it does in a conformance session.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import testenv


def half_done_backend():
    """The suite's backend with a few methods still missing, streams declared."""
    import chipset
    from chipset.interfaces import Stream

    real = chipset.backend()

    class Half(type(real.device)):
        def manual_seed(self, seed):
            raise NotImplementedError("acme: Device.manual_seed is not implemented yet")

        def get_rng_state(self, index=None):
            self.manual_seed(0)  # an implemented method calling a stub: the stub is what is missing

        def _properties(self, index):
            raise ValueError("wrong, but implemented: the device checks report this")

        def stream(self):
            s = super().stream()
            s.record_event = types.MethodType(lambda self, event=None: Stream.record_event(self), s)
            return s

    dev = Half()
    caps = dataclasses.replace(real.capabilities, streams=True, event_timing=True)
    return types.SimpleNamespace(device=dev, memory=type(real.memory)(dev), collective=type(real.collective)(dev),
                                 capabilities=caps)


def test_plan_lists_each_unimplemented_method_once_and_nothing_else():
    code = ("import json, chipset, test_conformance_plan as t; from chipset.conformance._plan import unimplemented; "
            "print(json.dumps([unimplemented(t.half_done_backend()), unimplemented(chipset.backend())]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=testenv.clean_env(),
                       cwd=Path(__file__).parent, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plan, finished = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(e["interface"], e["method"]) for e in plan] == [("Device", "manual_seed"), ("Stream", "record_event")]
    assert plan[0]["docs"] == "docs/writing-a-plugin.md §9 RNG: devices sharing one generator"
    assert plan[1]["docs"] == "docs/writing-a-plugin.md §9 Streams and event timing"
    assert finished == []  # the unmodified backend
