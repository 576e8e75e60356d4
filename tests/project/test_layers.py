"""Imports in core go down the rooms, never up, and no import circle exists (docs/concepts.md, "Rooms").

Each top-level package of ``chipset`` is a room on a layer; a module may import its own room
and the rooms below, at module level or inside a function alike: an import made late still
ties the two modules together, so it counts. There is no allow-list. A second check builds the
module-level graph of every import (function-local ones included) and asserts it has no
strongly connected component, so a circle inside one room is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "chipset"

LAYERS = [
    {"errors", "_version", "_process", "logs"},   # no chipset imports
    {"interfaces", "kernels"},                    # the backend contract and its primitives
    {"discovery", "loader", "__init__"},          # finding and loading backends; the facade
    {"preflight", "data"},                        # input checks; data on disk and datasets
    {"layers"},                                   # building blocks families share (MoE)
    {"parallel"},                                 # model-agnostic transforms, the plan vocabulary
    {"runtime"},                                  # data parallel + ZeRO, pipeline, precision
    {"models"},                                   # model families and their configs
    {"planner"},                                  # formulas; reads run configs by attribute
    {"train"},                                    # run config, loop, launch, checkpoints
    {"rl"},                                       # RL post-training on the engine (GRPO)
    {"conformance", "report", "diagnose", "plugin_kit", "api"},  # tools and the library API
    {"cli"},                                      # the command line
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for path in CORE.rglob("*.py"):
        parts = ["chipset", *path.relative_to(CORE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Every chipset module ``tree`` imports (absolute or relative, at any depth), except those under
    ``if TYPE_CHECKING:``, which never run."""
    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    yield f"{base}:{alias.name}"  # a submodule of ``base``, or a name in it (see _graph)
            yield from visit(child)
    yield from (m for m in visit(tree) if m.split(".")[0] == "chipset")


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name in _imports(ast.parse(path.read_text(), str(path)), mod, path.name == "__init__.py"):
            base, _, attr = name.partition(":")
            name = f"{base}.{attr}" if attr and f"{base}.{attr}" in mods else base
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                edges[mod].add(name)
    return edges


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_room_has_a_layer():
    rooms = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in CORE.glob("*.py")}
    assert rooms - set(LAYER) == set(), "place new rooms in LAYERS"


def test_imports_only_go_down_the_rooms():
    upward = [f"{src} imports {dst}: room {_room(src)} (layer {LAYER[_room(src)]}) -> "
              f"{_room(dst)} (layer {LAYER[_room(dst)]})"
              for src, dsts in sorted(_graph().items()) for dst in sorted(dsts)
              if LAYER[_room(dst)] > LAYER[_room(src)]]
    assert not upward, "imports going up the rooms (function-local ones count):\n" + "\n".join(upward)


def test_no_import_circle_in_core():
    circles = _circles(_graph())
    assert not circles, "import circles (function-local imports count):\n" + "\n".join(map(str, circles))


def test_the_checks_see_a_late_upward_import_and_a_circle():
    # Negative controls: a function-local upward import is an edge, and a two-module circle is found.
    tree = ast.parse("import os\nfrom chipset.train import loop\n\ndef f():\n    from chipset.cli import main\n"
                     "if TYPE_CHECKING:\n    from chipset.report import checks\n")
    found = set(_imports(tree, "chipset.models.family", False))
    assert {"chipset.train:loop", "chipset.cli:main"} <= found and "chipset.report:checks" not in found
    assert LAYER[_room("chipset.cli.main")] > LAYER[_room("chipset.models.family")]
    rel = set(_imports(ast.parse("from ..planner import run\nfrom . import check\n"), "chipset.runtime.pipeline.schedules",
                       False))
    assert {"chipset.runtime.planner:run", "chipset.runtime.pipeline:check"} <= rel
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


TESTS = Path(__file__).resolve().parents[1]
OUTSIDE_CORE = {"plugins": "the vendor plugins", "docs": "docs/ and examples/", "project": "the house as a whole"}


def test_the_tests_mirror_the_rooms():
    # Every test file sits in tests/<room>/, a room of core/chipset or one of OUTSIDE_CORE; none at the top.
    rooms = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | set(OUTSIDE_CORE)
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files at the top of tests/ (move each into tests/<room>/): {loose}"
    strays = sorted(str(p.relative_to(TESTS)) for p in TESTS.glob("*/test_*.py") if p.parent.name not in rooms)
    assert not strays, f"test folders that are not a room of core/chipset nor one of {sorted(OUTSIDE_CORE)}: {strays}"
