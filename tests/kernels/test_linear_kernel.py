"""The ``linear`` kernel slot: the engine builds every linear layer on the backend's ``linear``
(parallel/linear.py), resolved once (``KernelRegistry.resolve``); FP8 replaces it on the
projections it routes; LoRA's adapters use it. The backend here is cpu_sim with a registry of
its own holding a recording ``linear`` (``F.linear`` underneath, so the numbers are unchanged).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from chipset.errors import KernelNotFoundError
from chipset.kernels import KernelRegistry
from chipset.loader import backend as load_backend

MODEL = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "intermediate_size": 32}


class Recording:
    """A backend's ``linear``: ``F.linear``, recording the weight shape of every call."""

    def __init__(self):
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, x, weight, bias=None):
        self.calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)


def _build(kernels, **over):
    from chipset.models.registry import resolve_family
    from chipset.train.config import RunConfig
    from chipset.train.loop import build_model, make_dims

    b = dataclasses.replace(load_backend("cpu_sim"), kernels=kernels)
    cfg = RunConfig.from_dict({"model": {**MODEL, **over.get("model", {})},
                               "train": {"seq_len": 8, "global_batch": 2, "seed": 3, **over.get("train", {})}})
    cfg = cfg.validate(world_size=1)
    return build_model(cfg, b, make_dims(cfg, 1), resolve_family(cfg.model.family)).module


def _registry(fn=None) -> KernelRegistry:
    reg = KernelRegistry("recording")
    if fn is not None:
        reg.register("linear", fn)
    return reg


TOKENS = torch.randint(0, MODEL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))


def test_every_linear_layer_runs_the_backends_linear_with_the_same_numbers():
    rec = Recording()
    model = _build(_registry(rec))
    linears = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    logits = model(TOKENS)
    assert len(linears) == 7 * MODEL["num_hidden_layers"] + 1  # q k v o gate up down per block, the head
    assert rec.calls == linears  # each once per forward, in the model's order
    plain = _build(_registry())(TOKENS)  # nothing registered: the reference F.linear
    assert torch.equal(logits, plain)


def test_fp8_replaces_linear_on_its_projections_and_lora_adapters_use_it():
    rec = Recording()
    model = _build(_registry(rec), model={"lora_rank": 2}, train={"fp8": "tensorwise"})
    model(TOKENS)
    h, rank, inter, vocab = MODEL["hidden_size"], 2, MODEL["intermediate_size"], MODEL["vocab_size"]
    # FP8 computes the 7 projections of each block; the head (and the adapters, 2 GEMMs each) go through linear
    assert rec.calls.count((vocab, h)) == 1
    assert rec.calls.count((rank, h)) == 6 * MODEL["num_hidden_layers"]  # A of q k v o gate up (o: in = h)
    assert rec.calls.count((rank, inter)) == MODEL["num_hidden_layers"]  # A of down
    assert len(rec.calls) == 1 + 2 * 7 * MODEL["num_hidden_layers"]


def test_resolve_binds_the_reference_the_implementation_or_a_dispatcher():
    reg = KernelRegistry("t")
    assert reg.resolve("linear") is F.linear  # nothing registered: what nn.Linear calls
    rec = Recording()
    reg.register("linear", rec)
    assert reg.resolve("linear") is rec  # always available: no dispatch per call
    only_2d = KernelRegistry("t")
    only_2d.register("linear", rec, available=lambda x, weight, bias=None: x.dim() == 2)
    fn = only_2d.resolve("linear")
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.equal(fn(x, w), F.linear(x, w)) and rec.calls == [(5, 4)]
    fn(x.unsqueeze(0), w)  # the predicate says no: the reference runs
    assert rec.calls == [(5, 4)]
    with pytest.raises(KernelNotFoundError, match="no_such_kernel"):
        reg.resolve("no_such_kernel")


def test_attribute_dispatch_is_kept_until_the_name_is_registered_again():
    """``registry.linear(...)`` (every layer call) builds its dispatcher once and keeps it, still
    choosing by the arguments on each call; a later registration of that name is used from then on."""
    reg = KernelRegistry("t")
    first = reg.linear
    assert first is F.linear and reg.linear is first  # kept: the second read does not build again
    only_2d, always = Recording(), Recording()
    reg.register("linear", only_2d, available=lambda x, weight, bias=None: x.dim() == 2)
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.equal(reg.linear(x, w), F.linear(x, w)) and only_2d.calls == [(5, 4)]
    reg.linear(x.unsqueeze(0), w)  # the predicate, asked per call, says no: the reference runs
    assert only_2d.calls == [(5, 4)]
    reg.register("linear", always, priority=1)
    reg.linear(x.unsqueeze(0), w)
    assert always.calls == [(5, 4)] and only_2d.calls == [(5, 4)]
    with pytest.raises(KernelNotFoundError, match="no_such_kernel"):
        reg.no_such_kernel(torch.ones(1))
