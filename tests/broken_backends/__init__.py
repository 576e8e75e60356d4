"""Install the deliberately broken backends as a real distribution (a dist-info, as pip leaves it)."""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIST = "chipset-broken"
VERSION = "0.0.1"


def install(site: Path) -> Path:
    """Copy ``chipset_broken`` into ``site`` with its ``.dist-info``; put ``site`` on PYTHONPATH to use it."""
    site = Path(site)
    site.mkdir(parents=True, exist_ok=True)
    shutil.copytree(HERE / "chipset_broken", site / "chipset_broken", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"chipset_broken-{VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
    (info / "top_level.txt").write_text("chipset_broken\n")
    eps = "\n".join(f"{v} = chipset_broken:{v}" for v in _variants())
    (info / "entry_points.txt").write_text(f"[chipset.backends]\n{eps}\n")
    files = [p.relative_to(site).as_posix() for p in (site / "chipset_broken").rglob("*.py")]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return site


def _literal(name: str):
    import ast

    tree = ast.parse((HERE / "chipset_broken" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{name} not found in chipset_broken/__init__.py")


def _variants() -> tuple[str, ...]:
    return tuple(_literal("VARIANTS"))


def defects() -> dict[str, str]:
    """Each broken backend (not ``few_caps``, which is correct) and its one defect."""
    return dict(_literal("DEFECTS"))
