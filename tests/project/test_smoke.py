"""A first end-to-end check that the default backend loads and reports devices."""

import chipset


def test_default_backend_on_this_machine_is_the_simulator(monkeypatch):
    monkeypatch.delenv("CHIPSET_BACKEND", raising=False)
    b = chipset.backend()
    assert b.name == "cpu_sim"
    assert b.device.device_count() >= 1
    assert b.device.properties(0).total_memory > 0
