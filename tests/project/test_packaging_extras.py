"""Packaging metadata (issue 37): SPDX license strings and a PEP 639 setuptools floor in every
pyproject.toml, the core's declared extras with an `all` that covers them, a bounded chipset
requirement in the plugin scaffold, and a wheel build with no setuptools deprecation warning."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from chipset._version import __version__
from chipset.plugin_kit import scaffold

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: chipset depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = ["pyproject.toml"] + sorted(
    f"plugins/{p.name}/pyproject.toml" for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
# setuptools 77 is the first to read `license = "<SPDX expression>"` (PEP 639); older ones refuse it.
PEP639_SETUPTOOLS = Version("77")


def _load(rel: str) -> dict:
    return tomllib.loads((ROOT / rel).read_text(encoding="utf-8"))


def _core_extras() -> dict[str, list[Requirement]]:
    table = _load("pyproject.toml")["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in table.items()}


def test_every_bundled_distribution_has_a_pyproject():
    assert {"pyproject.toml", "plugins/cpu/pyproject.toml", "plugins/cpu_sim/pyproject.toml",
            "plugins/cuda/pyproject.toml", "plugins/ascend/pyproject.toml",
            "plugins/accelerator/pyproject.toml"} <= set(PYPROJECTS)


@pytest.mark.parametrize("rel", PYPROJECTS)
def test_license_is_an_spdx_string_and_setuptools_reads_it(rel):
    data = _load(rel)
    license_ = data["project"].get("license")
    assert isinstance(license_, str), (
        f"{rel}: project.license is {license_!r}; setuptools deprecates the table form "
        "(license = { text = ... }): write the SPDX expression as a string, e.g. license = \"Apache-2.0\"")
    assert re.fullmatch(r"[A-Za-z0-9.+\-]+( (AND|OR|WITH) [A-Za-z0-9.+\-]+)*", license_), f"{rel}: {license_!r}"
    # a License :: classifier next to an SPDX license is an error under setuptools >= 77
    classifiers = data["project"].get("classifiers", [])
    assert not [c for c in classifiers if c.startswith("License ::")], f"{rel}: {classifiers}"

    floors = [Requirement(r) for r in data["build-system"]["requires"] if Requirement(r).name == "setuptools"]
    assert len(floors) == 1, f"{rel}: build-system.requires names setuptools {len(floors)} times"
    lower = [Version(s.version) for s in floors[0].specifier if s.operator in (">=", ">", "==", "~=")]
    assert lower and max(lower) >= PEP639_SETUPTOOLS, (
        f"{rel}: build-system.requires {str(floors[0])!r} admits a setuptools older than "
        f"{PEP639_SETUPTOOLS}, which cannot read an SPDX license string")


def test_core_declares_extras_for_its_optional_outputs():
    extras = _core_extras()
    for extra, package in (("rich", "rich"), ("tensorboard", "tensorboard"), ("matplotlib", "matplotlib")):
        assert extra in extras, f"no chipset[{extra}] extra (declared: {sorted(extras)})"
        reqs = [r for r in extras[extra] if r.name == package]
        assert reqs and reqs[0].specifier, f"chipset[{extra}] must install {package} with a version floor"


def test_all_extra_covers_every_other_extra():
    extras = _core_extras()
    assert "all" in extras, f"no chipset[all] extra (declared: {sorted(extras)})"
    covered_extras: set[str] = set()
    covered_packages: set[str] = set()
    for req in extras["all"]:
        if req.name == "chipset":  # a self-reference: chipset[a,b] brings those extras
            assert not req.specifier and not req.marker, f"chipset[all]: {req} (a self-reference takes no version)"
            covered_extras |= set(req.extras)
        else:
            covered_packages.add(req.name)
    unknown = covered_extras - set(extras)
    assert not unknown, f"chipset[all] names extras that do not exist: {sorted(unknown)}"
    missing = [name for name, reqs in extras.items() if name != "all" and name not in covered_extras
               and not {r.name for r in reqs} <= covered_packages]
    assert not missing, f"chipset[all] does not cover the extras {missing}"


def test_cuda_triton_extra_is_the_range_tox_tests():
    (req,) = [Requirement(r) for r in _load("plugins/cuda/pyproject.toml")["project"]["optional-dependencies"]["triton"]]
    tox = (ROOT / "tox.ini").read_text(encoding="utf-8")
    # `    triton>=3.5,<4` or, in a factor-conditional env, `    cuda: triton>=3.5,<4`
    tested = [s.strip() for s in re.findall(r"^\s*(?:[\w,-]+:\s*)?triton\s*([<>=!~][^\n#]*)$", tox, flags=re.M)]
    assert tested, "tox.ini no longer installs triton with a version range"
    for spec in tested:
        assert req.specifier == SpecifierSet(spec), f"chipset-cuda[triton] declares {req} but tox.ini tests triton {spec}"


@pytest.mark.parametrize("rel", [p for p in PYPROJECTS if p.startswith("plugins/")])
def test_bundled_plugins_bound_chipset_above(rel):
    (req,) = [Requirement(r) for r in _load(rel)["project"]["dependencies"] if Requirement(r).name == "chipset"]
    assert req.specifier.contains(__version__), f"{rel}: {req} excludes chipset {__version__}"
    assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), f"{rel}: {req} has no upper bound"


def test_scaffold_pyproject_bounds_chipset_like_the_bundled_plugins(tmp_path):
    scaffold("acme_pkg", tmp_path / "p")
    data = tomllib.loads((tmp_path / "p" / "pyproject.toml").read_text(encoding="utf-8"))
    (req,) = [Requirement(r) for r in data["project"]["dependencies"] if Requirement(r).name == "chipset"]
    v = Version(__version__)
    assert req.specifier.contains(__version__), f"the scaffold's {req} excludes the chipset it was made by"
    next_breaking = f"{v.major}.{v.minor + 1}" if v.major == 0 else f"{v.major + 1}.0"
    assert not req.specifier.contains(next_breaking), (
        f"the scaffold's {req} admits chipset {next_breaking}, a release that may break plugins; "
        "bound it above like the bundled plugins (chipset>=0.1,<0.2)")
    bundled = {str(r) for r in (Requirement(s) for s in _load("plugins/cpu/pyproject.toml")["project"]["dependencies"])
               if r.name == "chipset"}
    assert str(req) in bundled, f"the scaffold declares {req}, the bundled plugins {sorted(bundled)}"


def test_core_wheel_builds_without_deprecation_and_carries_the_new_metadata(tmp_path):
    # Build from a copy so the shared checkout gets no build/ or egg-info writes.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "core" / "chipset", src / "core" / "chipset",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=240)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "SetuptoolsDeprecationWarning" not in log, log[-4000:]
    deprecations = [line for line in log.splitlines() if "deprecat" in line.lower()]
    assert not deprecations, "\n".join(deprecations)

    (wheel,) = out.glob("chipset-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = zf.read(name).decode()
    headers = meta.split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers, [h for h in headers if h.startswith("License")]
    assert not [h for h in headers if h.startswith("License:")], "a License: field next to License-Expression"
    for extra in ("all", "rich", "tensorboard", "matplotlib"):
        assert f"Provides-Extra: {extra}" in headers, extra
