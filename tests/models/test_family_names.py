"""No code outside the families' own folder names a family's modules.

Every package but the families' own (chipset/models) reaches a model only through the family
contract (chipset.models.family). This test collects every submodule name of the built-in
families' models (built on the meta device) and looks for them in the other packages' source
as attribute accesses and string constants. The planner is left out: it describes models by
its own ModelSpec fields (``layers``, ``mlp``, ``norm``: counts and kinds), read from configs.
So is chipset/layers: the building blocks families are made of name their own submodules
(the MoE layer's ``gate_proj``), and a family that uses one takes those names with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core" / "chipset"
SKIPPED = ("models/", "layers/", "planner/")

# Same spelling, other meaning: (file, name) -> what it is.
NOT_A_MODULE = {
    ("train/loop.py", "blocks"): "the contract's ModelFamily.blocks(model)",
    ("cli/plan.py", "layers"): "the planner's ModelSpec.layers (a count)",
    ("cli/plan_config.py", "layers"): "the planner's ModelSpec.layers (a count)",
    ("cli/plan_config.py", "mlp"): "the planner's ModelSpec.mlp field (a kind of MLP)",
    ("cli/plan_config.py", "norm"): "the planner's ModelSpec.norm field (a kind of norm)",
    ("report/__init__.py", "stem"): "pathlib.Path.stem",
    ("runtime/optim.py", "norm"): "torch.Tensor.norm (Muon's Newton-Schulz scales a matrix by its norm)",
}


def _module_names() -> set[str]:
    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family
    from chipset.train.config import load_config

    names = set()
    for family in ("transformer", "gpt2", "resnet"):
        cfg = load_config(None, [f'model.family="{family}"'])
        for name, _ in meta_model(resolve_family(family), cfg).named_modules():
            names |= {part for part in name.split(".") if part and not part.isdigit()}
    return names


def _uses(source: str, names: set[str]):
    for node in ast.walk(ast.parse(source)):
        value = node.attr if isinstance(node, ast.Attribute) else (
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
        if value in names:
            yield value, node.lineno


def _scan(names: set[str]) -> list[str]:
    found = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        if rel.startswith(SKIPPED):
            continue
        for name, line in _uses(path.read_text(), names):
            if (rel, name) not in NOT_A_MODULE:
                found.append(f"{rel}:{line} names {name!r}")
    return found


@pytest.fixture(scope="module")
def module_names():
    names = _module_names()
    assert {"embed_tokens", "self_attn", "lm_head", "wte", "stem"} <= names  # the collection works
    return names


def test_no_file_outside_the_families_names_a_family_module(module_names):
    found = _scan(module_names)
    assert not found, "a family's module named outside chipset/models:\n" + "\n".join(found)
    still = {(rel, n) for rel, n in NOT_A_MODULE if any(True for _ in _uses((CORE / rel).read_text(), {n}))}
    assert still == set(NOT_A_MODULE), "NOT_A_MODULE lists names that are gone: remove them"


def test_the_scan_sees_a_module_name(module_names):
    # Negative control: the engine's old pipeline split read these names.
    src = "def f(model):\n    return [model.embed_tokens, *model.layers, model.head]\n"
    assert sorted(n for n, _ in _uses(src, module_names)) == ["embed_tokens", "head", "layers"]


def test_the_built_in_family_has_no_special_path_outside_models():
    """The built-in transformer is reached only through the family contract: no isinstance
    check on it and no test of its name outside chipset/models (issue 30's back doors)."""
    hits = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        if rel.startswith("models/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "TransformerFamily" in line or '("", "transformer")' in line or "== \"transformer\"" in line:
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "special paths for the built-in family outside models/:\n" + "\n".join(hits)
