"""RNG: per-device seeding, reproducibility, state round-trip and fork_rng isolation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chipset.loader import Backend


def _draw(dev, n=64):
    return torch.rand(n, device=dev).cpu()


def test_same_seed_same_numbers(backend: Backend, dev):
    backend.device.manual_seed(1234)
    a = _draw(dev)
    backend.device.manual_seed(1234)
    assert torch.equal(a, _draw(dev))


def test_different_seeds_differ(backend: Backend, dev):
    backend.device.manual_seed(1)
    a = _draw(dev)
    backend.device.manual_seed(2)
    assert not torch.equal(a, _draw(dev))


def test_successive_draws_differ(backend: Backend, dev):
    backend.device.manual_seed(7)
    assert not torch.equal(_draw(dev), _draw(dev))


def test_state_round_trip_replays_the_stream(backend: Backend, dev):
    d = backend.device
    d.manual_seed(99)
    state = d.get_rng_state(0)
    assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.device.type == "cpu"
    a = _draw(dev)
    d.set_rng_state(state, 0)
    assert torch.equal(a, _draw(dev))


def test_fork_rng_isolates_the_block(backend: Backend, dev):
    d = backend.device
    d.manual_seed(5)
    expected = _draw(dev)
    d.manual_seed(5)
    with d.fork_rng(devices=[0]):
        d.manual_seed(12345)
        _draw(dev, 1000)
    assert torch.equal(expected, _draw(dev))


def test_manual_seed_all_seeds_every_device(backend: Backend):
    d = backend.device
    n = min(d.device_count(), 2)
    d.manual_seed_all(42)
    states = [d.get_rng_state(i) for i in range(n)]
    assert all(torch.equal(states[0], s) for s in states[1:])
    d.manual_seed(42)
    assert torch.equal(d.get_rng_state(0), states[0])
