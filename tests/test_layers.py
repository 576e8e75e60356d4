"""Imports in core go down the layers, never up (docs/engine.md, "Layers").

Each top-level package of ``chipset`` sits on a layer; a module may import its own layer and
the ones below at module level. An upward import is allowed only inside a function (done when
called, so no import circle forms at load time) and only where it is listed in ``LATE``
with why: the list is the architecture's remaining debt, and it may only shrink - a listed
import that is gone fails the test too, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "chipset"

LAYERS = [
    {"errors", "_version", "_process", "logs"},           # no chipset imports
    {"interfaces", "kernels", "tokens"},                   # contracts and primitives
    {"discovery", "loader", "__init__"},                   # finding and loading backends; the facade
    {"preflight"},                                         # input checks of any command
    {"planner"},                                           # formulas; reads configs by attribute
    {"config"},                                            # the run configuration
    {"models"},                                            # model families
    {"engine"},                                            # parallel engine and launch
    {"conformance", "report", "plugin_kit", "api"},        # tools and the library API on the engine
    {"cli"},                                               # the command line
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# (importing file relative to core/chipset, imported package) -> why it may import upward late.
LATE = {
    ("preflight.py", "planner"): "memory preflight asks the planner for the per-rank peak",
    ("config.py", "models"): "an HF config.json is translated by the HF family (model.hf_config)",
    ("config.py", "engine"): "pipeline layout problems are the pipeline splitter's own rules",
    ("models/family.py", "engine"): "a token family's default data is the engine's token dataset, and a "
                                    "family's pipeline chain is checked and its pipeline_split read by "
                                    "the engine's splitter rules",
    ("planner/model.py", "models"): "a train config naming an HF model is planned from its config.json, "
                                    "translated by the HF family (models/hf/plan.py)",
    ("models/hf/weights.py", "engine"): "loading HF weights into a layout needs the checkpoint's shard layout",
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "chipset" and len(parts) > 1 else ("__init__" if module == "chipset" else None)


def _imports(tree: ast.AST):
    """(imported module, at module level?) for every absolute import in ``tree``."""
    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, top
            yield from visit(child, inner)
    yield from visit(tree, True)


def _edges():
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for module, top in _imports(ast.parse(path.read_text(), str(path))):
            dst = _package(module)
            if dst is not None and dst != src:
                yield rel.as_posix(), src, dst, top


def test_every_package_has_a_layer():
    packages = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in CORE.glob("*.py")}
    assert packages - set(LAYER) == set(), "place new packages in LAYERS"


def test_imports_only_go_down():
    upward, late_seen = [], set()
    for rel, src, dst, top in _edges():
        if LAYER[dst] <= LAYER[src]:
            continue
        if not top and (rel, dst) in LATE:
            late_seen.add((rel, dst))
            continue
        upward.append(f"{rel} imports chipset.{dst} ({'module level' if top else 'in a function, not in LATE'}): "
                      f"layer {LAYER[src]} -> {LAYER[dst]}")
    assert not upward, "imports going up the layers:\n" + "\n".join(upward)
    assert set(LATE) - late_seen == set(), "LATE lists imports that are gone: remove them from the list"


def test_the_check_sees_an_upward_import(tmp_path):
    # The negative control: a module-level upward import is found.
    tree = ast.parse("import os\nfrom chipset.engine import trainer\n\ndef f():\n    from chipset.cli import main\n")
    assert list(_imports(tree)) == [("os", True), ("chipset.engine", True), ("chipset.cli", False)]
    assert LAYER[_package("chipset.engine")] > LAYER["config"]
