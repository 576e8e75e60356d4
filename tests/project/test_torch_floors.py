"""Each plugin's declared torch floor covers the torch APIs its code calls.

A plugin that calls an API newer than its floor installs fine and then fails at the first
call on the oldest torch it claims to support (the CUDA plugin passed ``enable_gqa``,
torch >= 2.5, while declaring torch >= 2.4). The floor itself is certified by
``tox -e torch-floor``, which installs constraints-floor.txt's release; every pyproject.toml
must declare exactly that release.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _pin() -> tuple[int, int]:
    m = re.search(r"^torch==(\d+)\.(\d+)\.\d+\s*$", (ROOT / "constraints-floor.txt").read_text(), re.M)
    assert m, "constraints-floor.txt: no torch==X.Y.Z pin"
    return int(m[1]), int(m[2])


@pytest.mark.parametrize("pyproject", ["pyproject.toml"] + sorted(
    f"plugins/{p.name}/pyproject.toml" for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()))
def test_every_declared_floor_is_the_release_the_floor_env_certifies(pyproject):
    # tox -e torch-floor installs constraints-floor.txt's torch and runs the conformance
    # suites and a two-rank ZeRO-3 run on it; a floor below that release is a promise no
    # test keeps, a floor above it leaves the release the env tests unsupported.
    assert _floor(ROOT / pyproject) == _pin(), (
        f"{pyproject} declares torch >= {'.'.join(map(str, _floor(ROOT / pyproject)))}, constraints-floor.txt "
        f"(what `tox -e torch-floor` tests) pins {'.'.join(map(str, _pin()))}: change both together")


def test_the_floor_env_runs_in_ci():
    """The floor env is out of tox's default envlist (its 3.5 GB download), so CI runs it by
    name after the README's test command, and the README's "Testing" section says so."""
    text = (ROOT / "tox.ini").read_text()
    assert re.search(r"^\[testenv:torch-floor\]$", text, re.M)
    assert "PIP_CONSTRAINT = {toxinidir}/constraints-floor.txt" in text
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme_command = "python3 -m venv .venv && . .venv/bin/activate && pip install tox && tox"
    assert readme_command in ci and "tox -e torch-floor" in ci[ci.index(readme_command) + 1:]
    testing = (ROOT / "README.md").read_text().split("## Testing", 1)[1].split("\n## ", 1)[0]
    assert "tox -e torch-floor" in testing
