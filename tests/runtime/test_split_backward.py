"""A backward split into its input half and its deferred weight half (zero-bubble schedules) gives
exactly the whole backward's gradients: the same autograd nodes run on the same incoming
gradients, so the comparisons below are bitwise (``torch.equal``), not within a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chipset.runtime.pipeline.split_backward import backward_input


class Stage(nn.Module):
    """A pipeline stage's shape in small: a residual MLP with a norm, and optionally a weight used twice."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.RMSNorm(16)
        self.down = nn.Linear(16, 8, bias=False)
        self.shared = shared

    def forward(self, x):
        y = x + self.down(F.silu(self.norm(self.up(x))))
        if self.shared:  # the same weight again, further along the input path
            y = y + self.down(F.silu(self.norm(self.up(y))))
        return y


def _grads(stage) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}


def _whole(stage, x, g):
    x = x.detach().requires_grad_(True)
    stage(x).backward(g)
    out = _grads(stage), x.grad
    stage.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_split_backward_equals_the_whole_backward_bit_for_bit(shared):
    torch.manual_seed(0)
    stage = Stage(shared)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    want, want_dx = _whole(stage, x, g)
    xi = x.detach().requires_grad_(True)
    dx, weights = backward_input([stage(xi)], [g], xi)
    assert torch.equal(dx, want_dx)
    assert all(v is None for v in _grads(stage).values())  # the input half accumulates nothing
    assert xi.grad is None
    weights.run()
    got = _grads(stage)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_first_stage_defers_its_whole_backward_and_an_off_path_root_is_kept():
    torch.manual_seed(1)
    stage = Stage()
    x, g = torch.randn(4, 8), torch.randn(4, 8)

    def roots(xi):  # the output and an auxiliary loss of the weights alone (off the input path)
        return [stage(xi), stage.up.weight.square().sum() * 0.1]

    xi = x.detach().requires_grad_(True)
    torch.autograd.backward(roots(xi), [g, None])
    want, want_dx = _grads(stage), xi.grad
    stage.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    dx, weights = backward_input(roots(xi), [g, None], xi)
    weights.run()
    assert torch.equal(dx, want_dx)
    for n, v in _grads(stage).items():
        assert torch.equal(v, want[n]), n
    stage.zero_grad(set_to_none=True)
    none, weights = backward_input([stage(x)], [g], None)  # the first stage: no input gradient to send
    assert none is None and all(v is None for v in _grads(stage).values())
    weights.run()
    first = _grads(stage)
    stage.zero_grad(set_to_none=True)
    stage(x).backward(g)
    for n, v in _grads(stage).items():
        assert torch.equal(first[n], v), n


def test_weight_half_accumulates_into_existing_grads_and_fires_each_hook_once():
    torch.manual_seed(2)
    stage = Stage()
    fired: dict[str, int] = {}
    for n, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    x, g = torch.randn(3, 8), torch.randn(3, 8)
    pending = []
    for _ in range(2):  # two micro-batches, their weight halves run later, in order
        xi = x.detach().requires_grad_(True)
        pending.append(backward_input([stage(xi)], [g], xi)[1])
    assert fired == {}
    for w in pending:
        w.run()
    assert fired == {n: 2 for n, _ in stage.named_parameters()}
    twice = _grads(stage)
    stage.zero_grad(set_to_none=True)
    stage(x).backward(g)
    stage(x).backward(g)
    for n, v in _grads(stage).items():
        assert torch.equal(twice[n], v), n


def test_a_transformer_stage_splits_exactly():
    from chipset.kernels import KernelRegistry
    from chipset.models import Transformer
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict({"model": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "num_key_value_heads": 2,
                                         "intermediate_size": 48}})
    model = Transformer(cfg.model, KernelRegistry("reference"), seed=3)
    x, g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4)), torch.randn(2, 8, 32)

    def stage(xi):
        for block in model.layers:
            xi = block(xi)
        return xi

    xi = x.clone().requires_grad_(True)
    stage(xi).backward(g)
    want = {n: p.grad.clone() for n, p in model.layers.named_parameters()}
    model.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_(True)
    dx, weights = backward_input([stage(xs)], [g], xs)
    assert torch.equal(dx, xi.grad)
    weights.run()
    for n, p in model.layers.named_parameters():
        assert torch.equal(p.grad, want[n]), n
