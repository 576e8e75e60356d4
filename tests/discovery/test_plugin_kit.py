"""The plugin kit, walked as a vendor would: scaffold, install into a venv, list, certify."""

from __future__ import annotations

import json
import os
import site
import sys
import venv
from pathlib import Path

import pytest

import forked_cli
from chipset.errors import UsageError
from chipset.plugin_kit import scaffold
from chipset.plugin_kit.contract import METHODS, SECTIONS


def _child_venv(path: Path) -> Path:
    """A real venv that also sees this environment's packages (chipset, torch) via a .pth file.

    No pip of its own (ensurepip costs seconds): this environment's pip installs into it
    with ``--python``.
    """
    venv.EnvBuilder(with_pip=False).create(path)
    py = path / "bin" / "python"
    purelib = forked_cli.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    parent = [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()
    # addsitedir (not a bare path) so the parent's own .pth files, e.g. editable installs, apply too
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(parent)]
    (Path(purelib) / "zz_parent_env.pth").write_text("\n".join(lines) + "\n")
    return py


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "PIP_CONSTRAINT"))}


@pytest.fixture(scope="module")
def installed_scaffold(tmp_path_factory):
    root = tmp_path_factory.mktemp("kit")
    target = root / "chipset-acme-npu"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "plugin", "new", "acme_npu", "--dir", str(target)],
                       capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    py = _child_venv(root / "venv")
    r = forked_cli.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-build-isolation", "-e", str(target)],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return py, target


def test_scaffold_refuses_bad_names_and_non_empty_directories(tmp_path):
    with pytest.raises(UsageError, match="not valid"):
        scaffold("Acme-NPU", tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        scaffold("acme", tmp_path / "b")
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"


def test_installed_scaffold_is_listed_but_never_chosen_implicitly(installed_scaffold):
    py, _ = installed_scaffold
    r = forked_cli.run([py, "-m", "chipset.cli.main", "backends", "--json"], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    by = {b["name"]: b for b in data["backends"]}
    assert by["acme_npu"]["distribution"] == "chipset-acme-npu"
    assert by["acme_npu"]["status"] == "unavailable"
    # automatic selection keeps the installed default (cpu, or cpu_sim where cpu is not installed)
    assert data["selected"] in ("cpu", "cpu_sim") and by[data["selected"]]["status"] == "ok"
    r = forked_cli.run([py, "-m", "chipset.cli.main", "backends", "--json"], capture_output=True, text=True,
                       env={**_env(), "CHIPSET_BACKEND": "acme_npu"})
    data = json.loads(r.stdout)
    assert data["selected"] == "acme_npu"


def test_scaffold_backend_names_the_first_missing_part(installed_scaffold):
    py, _ = installed_scaffold
    r = forked_cli.run([py, "-m", "chipset.cli.main", "info"], capture_output=True, text=True,
                       env={**_env(), "CHIPSET_BACKEND": "acme_npu"})
    assert r.returncode != 0
    assert "acme_npu: Device.device_count is not implemented yet" in r.stderr


def test_scaffold_stubs_every_required_method_of_the_contract_naming_its_docs_section(tmp_path):
    scaffold("acme_x", tmp_path / "p")
    code = (tmp_path / "p" / "chipset_acme_x" / "backend.py").read_text()
    for m in METHODS:  # an optional method (streams, events) keeps the Device default: no stub
        stub = f'_todo("{m.interface}.{m.method}", "{SECTIONS[m.section]}")'
        assert (stub in code) == m.required, (m.interface, m.method)
    assert "class AcmeXStream" not in code and "class AcmeXEvent" not in code
    assert "raise OutOfMemoryError(" in code and "Tried to allocate" in code  # the host accounting pattern
    for part in ("register_kernels", "launch_env", "capabilities"):  # the spec's optional and computed parts
        assert f"def {part}(" in code and f"    {part}={part},\n" in code
    assert "spec = BackendSpec(" in code and "hookimpl" not in code
    descriptor = (tmp_path / "p" / "chipset_acme_x" / "__init__.py").read_text()
    assert "return backend.spec" in descriptor
    assert "profiles=_profiles" in descriptor and "device_initialized=_device_initialized" in descriptor


def test_conformance_on_the_scaffold_prints_one_work_plan_and_fails(installed_scaffold, tmp_path):
    py, _ = installed_scaffold
    report = tmp_path / "r.json"
    r = forked_cli.run(
        [py, "-m", "chipset.cli.main", "conformance", "--backend", "acme_npu", "--json-report", str(report)],
        capture_output=True, text=True, env={**_env(), "CHIPSET_BACKEND": "acme_npu"}, timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    # streams and events have defaults: the plan is the required methods
    expected = [(m.interface, m.method, m.section) for m in METHODS if m.required]
    for iface, method, key in expected:
        lines = [ln for ln in out.splitlines() if ln.split()[:1] == [f"{iface}.{method}"]]
        assert len(lines) == 1, (iface, method, out[-3000:])
        assert lines[0].endswith(f"docs/writing-a-plugin.md {SECTIONS[key]}")
    # the plan instead of one error per check: no check ran, the error is named once (the header)
    assert out.count("NotImplementedError") == 1 and "ERROR" not in out and "FAILED" not in out, out[-3000:]
    data = json.loads(report.read_text())
    assert [(e["interface"], e["method"]) for e in data["work_plan"]] == [(i, m) for i, m, _ in expected]
    assert data["summary"] == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}


def test_keep_going_runs_the_checks_of_an_unfinished_backend(installed_scaffold, tmp_path):
    py, _ = installed_scaffold
    report = tmp_path / "r.json"
    r = forked_cli.run(
        [py, "-m", "chipset.cli.main", "conformance", "--backend", "acme_npu", "--json-report", str(report),
         "--keep-going", "-k", "test_device_count_is_positive"],
        capture_output=True, text=True, env={**_env(), "CHIPSET_BACKEND": "acme_npu"}, timeout=600,
    )
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    data = json.loads(report.read_text())
    assert data["work_plan"] and [t["outcome"] for t in data["tests"]] == ["error"]
    assert "acme_npu: Device.device_count is not implemented yet" in data["tests"][0]["reason"]
