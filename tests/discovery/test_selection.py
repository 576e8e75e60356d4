"""Every backend-selection rule, against real installed plugin distributions."""

from __future__ import annotations

import pytest

from chipset.discovery import discover, select
from chipset.errors import BackendSelectionError, BackendUnavailableError
from plugin_factory import make_plugin


def _select(name=None):
    return select(name, discover(refresh=True))


def test_unset_prefers_available_hardware_over_the_simulator(site):
    make_plugin(site, "acme", priority=1)
    sel = _select()
    assert sel.record.name == "acme"
    assert "highest-priority available hardware" in sel.reason


def test_simulator_never_wins_over_hardware_even_with_higher_priority(site):
    make_plugin(site, "acme", priority=1)
    make_plugin(site, "fastsim", priority=1000, simulator=True)
    assert _select().record.name == "acme"


def test_highest_priority_hardware_wins(site):
    make_plugin(site, "low", priority=10)
    make_plugin(site, "high", priority=20)
    assert _select().record.name == "high"


def test_unavailable_hardware_is_not_chosen_and_the_reason_is_given(site):
    make_plugin(site, "offline", priority=500, probe_body="return False, 'no devices on the bus'")
    sel = _select()
    assert sel.record.name == "cpu_sim"
    assert "offline: no devices on the bus" in sel.reason


def test_tied_hardware_priorities_are_an_error_asking_for_chipset_backend(site):
    make_plugin(site, "alpha", priority=70)
    make_plugin(site, "beta", priority=70)
    with pytest.raises(BackendSelectionError) as err:
        _select()
    msg = str(err.value)
    assert "alpha, beta" in msg and "CHIPSET_BACKEND" in msg
    assert err.value.exit_code == 2


def test_strict_name_selects_even_the_simulator(site, monkeypatch):
    make_plugin(site, "acme", priority=10)
    monkeypatch.setenv("CHIPSET_BACKEND", "cpu_sim")
    sel = _select()
    assert sel.record.name == "cpu_sim"
    assert sel.reason == "requested by CHIPSET_BACKEND=cpu_sim"


def test_strict_unknown_name_lists_installed_backends(monkeypatch):
    monkeypatch.setenv("CHIPSET_BACKEND", "nosuch")
    with pytest.raises(BackendSelectionError) as err:
        _select()
    msg = str(err.value)
    assert "unknown backend 'nosuch'" in msg
    for name in ("cpu_sim", "cuda", "ascend"):
        assert name in msg
    assert err.value.exit_code == 2


def test_strict_unavailable_name_is_an_error_with_the_reason(monkeypatch):
    monkeypatch.setenv("CHIPSET_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError) as err:
        _select()
    assert "'cuda' was requested" in str(err.value)
    assert "not a CUDA build" in str(err.value)
    assert err.value.exit_code == 2


def test_ordered_preference_takes_the_first_available_and_says_what_it_skipped(monkeypatch):
    monkeypatch.setenv("CHIPSET_BACKEND", "cuda,ascend,cpu_sim")
    sel = _select()
    assert sel.record.name == "cpu_sim"
    assert "first available" in sel.reason
    assert "cuda: unavailable" in sel.reason and "ascend: unavailable" in sel.reason


def test_ordered_preference_respects_order_not_priority(site, monkeypatch):
    make_plugin(site, "acme", priority=100)
    monkeypatch.setenv("CHIPSET_BACKEND", "cpu_sim,acme")
    assert _select().record.name == "cpu_sim"


def test_ordered_preference_with_nothing_available_fails(monkeypatch):
    monkeypatch.setenv("CHIPSET_BACKEND", "cuda,ascend")
    with pytest.raises(BackendUnavailableError, match="none of the backends"):
        _select()


@pytest.mark.parametrize("value", ["cuda,", ",cpu_sim", "cpu sim", "cuda;cpu_sim", "a,,b"])
def test_malformed_chipset_backend_is_a_usage_error(monkeypatch, value):
    monkeypatch.setenv("CHIPSET_BACKEND", value)
    with pytest.raises(BackendSelectionError, match="malformed") as err:
        _select()
    assert err.value.exit_code == 2


def test_disabled_plugin_cannot_be_selected(monkeypatch):
    monkeypatch.setenv("CHIPSET_DISABLE_PLUGINS", "cpu_sim")
    monkeypatch.setenv("CHIPSET_BACKEND", "cpu_sim")
    with pytest.raises(BackendUnavailableError, match="disabled"):
        _select()


def test_nothing_available_at_all_explains_how_to_fix(monkeypatch):
    monkeypatch.setenv("CHIPSET_DISABLE_PLUGINS", "cpu_sim,cpu")
    with pytest.raises(BackendUnavailableError, match="pip install chipset-cpu-sim"):
        _select()


def test_two_distributions_providing_one_name_are_refused_when_selected(site, monkeypatch):
    make_plugin(site, "twin", dist="vendor-a-twin", priority=5)
    make_plugin(site, "twin", dist="vendor-b-twin", priority=5, entry_value="plugin_twin:descriptor")
    monkeypatch.setenv("CHIPSET_BACKEND", "twin")
    with pytest.raises(BackendSelectionError, match="more than one distribution"):
        _select()
