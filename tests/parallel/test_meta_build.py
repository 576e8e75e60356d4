"""Models built on the meta device (chipset.parallel.meta.on_meta) skip their initialisers: same
names and shapes as a plain ``torch.device("meta")`` build, no random numbers drawn, and none of
the compiler stack (torch._dynamo) imported by a process that only builds one."""

from __future__ import annotations

import torch

import testenv
from chipset.models.registry import resolve_family
from chipset.parallel.meta import on_meta
from chipset.train.config import load_config


def _cfg():
    return load_config(None, ["model.num_hidden_layers=2", "model.hidden_size=32", "model.intermediate_size=64",
                              "model.num_attention_heads=4", "model.num_key_value_heads=2"])


def test_the_model_has_the_names_and_shapes_of_a_plain_meta_build_and_draws_no_random_numbers():
    family = resolve_family("transformer")
    with torch.device("meta"):
        plain = family.build(_cfg())
    torch.manual_seed(3)
    with on_meta():
        skipped = family.build(_cfg())
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))  # the build consumed nothing from the generator
    got = {n: (p.shape, p.dtype, p.device.type) for n, p in skipped.named_parameters()}
    assert got == {n: (p.shape, p.dtype, p.device.type) for n, p in plain.named_parameters()}
    assert {n: b.shape for n, b in skipped.named_buffers()} == {n: b.shape for n, b in plain.named_buffers()}


def test_initialisers_still_run_on_real_tensors_inside_the_context():
    real = torch.zeros(8)
    with on_meta():
        torch.nn.init.normal_(real)
        meta = torch.nn.Linear(3, 3)
    assert real.abs().sum() > 0 and meta.weight.is_meta


def test_building_the_meta_model_imports_no_compiler_stack():
    code = ("from chipset.models.family import meta_model\n"
            "from chipset.models.registry import resolve_family\n"
            "from chipset.train.config import load_config\n"
            "meta_model(resolve_family('transformer'), load_config(None, []))\n")
    assert testenv.compiler_modules_after(code) == []
