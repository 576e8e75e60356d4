"""Each plugin's declared torch floor covers the torch APIs its code calls.

A plugin that calls an API newer than its floor installs fine and then fails at the first
call on the oldest torch it claims to support (the CUDA plugin passed ``enable_gqa``,
torch >= 2.5, while declaring torch >= 2.4).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# API spelling in source -> the first torch release that has it
NEWER_APIS = {"enable_gqa": (2, 5)}


def _floor(pyproject: Path) -> tuple[int, int]:
    m = re.search(r'"torch\s*>=\s*(\d+)\.(\d+)', pyproject.read_text())
    assert m, f"{pyproject}: no torch>=X.Y requirement"
    return int(m[1]), int(m[2])


@pytest.mark.parametrize("plugin", sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()))
def test_declared_torch_floor_covers_the_apis_used(plugin):
    base = ROOT / "plugins" / plugin
    floor = _floor(base / "pyproject.toml")
    for src in base.rglob("*.py"):
        text = src.read_text()
        for api, since in NEWER_APIS.items():
            if api in text:
                assert floor >= since, (
                    f"{src.relative_to(ROOT)} uses {api} (torch >= {since[0]}.{since[1]}) but "
                    f"plugins/{plugin}/pyproject.toml declares torch >= {floor[0]}.{floor[1]}"
                )
