"""Routing a user's model through the ``linear`` kernel slot swaps modules, never patches them
(parallel/linear.py): every plain ``nn.Linear`` the user built keeps its class and gains no
attribute; the routed stand-ins hold the very same Parameter objects (names, identity, ties) and
the user's hooks; LoRA's adapters and FP8's product land on the stand-ins.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chipset.kernels import KernelRegistry
from chipset.loader import backend as load_backend

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    """The user's model: plain nn.Linear layers, one held under two names."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 4)
        self.again = self.head

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


class Recording:
    """A backend's ``linear``: ``F.linear``, recording the weight shape of every call."""

    def __init__(self):
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, x, weight, bias=None):
        self.calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)


def _build(net: nn.Module, rec: Recording, **model):
    from chipset.api import ModuleFamily
    from chipset.train.config import RunConfig
    from chipset.train.loop import build_model, make_dims

    reg = KernelRegistry("recording")
    reg.register("linear", rec)
    b = dataclasses.replace(load_backend("cpu_sim"), kernels=reg)
    fp8 = model.pop("fp8", "off")
    cfg = RunConfig.from_dict({"model": model, "train": {"seq_len": 8, "global_batch": 2, "fp8": fp8}})
    cfg = cfg.validate(world_size=1)
    family = ModuleFamily(net, {"up": "colwise", "down": "rowwise"})
    return build_model(cfg, b, make_dims(cfg, 1), family).module


def _snapshot(net: nn.Module) -> list[tuple[nn.Module, type, dict]]:
    return [(m, type(m), dict(vars(m))) for m in net.modules()]


@pytest.fixture
def user():
    net = Net()
    want = net(X).detach()
    seen = []
    handle = net.up.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    return net, _snapshot(net), want, seen, handle


def _untouched(snapshot):
    for mod, cls, state in snapshot:
        assert type(mod) is cls, f"{cls.__name__} became {type(mod).__name__}"
        if cls is nn.Linear:
            assert "linear" not in vars(mod) and "product" not in vars(mod)
            assert vars(mod) == state  # same keys and values: nothing set, nothing replaced
            assert dict(mod._parameters) == state["_parameters"] and not mod._modules  # no adapters added


def test_routing_swaps_the_users_linears_and_keeps_their_parameters_and_hooks(user):
    net, snapshot, want, seen, handle = user
    params = dict(net.named_parameters(remove_duplicate=False))
    keys = list(net.state_dict())
    rec = Recording()
    model = _build(net, rec)
    _untouched(snapshot)
    got = dict(model.named_parameters(remove_duplicate=False))
    assert got.keys() == params.keys() and all(got[n] is p for n, p in params.items())
    assert list(model.state_dict()) == keys
    assert model.again is model.head  # one layer under two names stays one module
    assert not any(type(m) is nn.Linear for m in model.modules())
    y = model(X)
    assert rec.calls == [(16, 8), (8, 16), (4, 8)]  # each layer once, through the backend's linear
    assert torch.equal(y, want)
    assert seen == [torch.Size([3, 16])]  # the user's hook came along
    handle.remove()  # and the user's handle still removes it
    model(X)
    assert len(seen) == 1


def test_lora_and_fp8_act_on_the_stand_ins_not_the_users_layers(user):
    from chipset.parallel.fp8 import Fp8Linear, gathered_weights
    from chipset.parallel.linear import KernelLinear

    net, snapshot, _, _, _ = user
    rec = Recording()
    model = _build(net, rec, lora_rank=2, fp8="tensorwise")
    _untouched(snapshot)
    assert all(type(model.get_submodule(n)) is KernelLinear for n in ("up", "down", "head"))
    assert isinstance(model.up.product, Fp8Linear) and isinstance(model.down.product, Fp8Linear)
    assert model.head.product is rec  # FP8 takes its projections only
    assert gathered_weights(model) == [model.up.weight, model.down.weight]
    assert {n for n, _ in model.named_parameters() if "lora_" in n} == {
        "up.lora_A.weight", "up.lora_B.weight", "down.lora_A.weight", "down.lora_B.weight"}
    model(X)
    assert sorted(rec.calls) == sorted([(2, 8), (16, 2), (2, 16), (8, 2), (4, 8)])  # adapters, head
