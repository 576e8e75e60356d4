"""The diagnostic CLI: output shapes, exit codes and error texts, run as a user would."""

from __future__ import annotations

import json
import sys

import forked_cli
import testenv
from conftest import run_cli
from plugin_factory import make_plugin


def test_backends_json_has_the_documented_shape_and_selects_cpu_sim():
    r = run_cli("backends", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"api_version", "selected", "selection_reason", "backends", "torch_build"}
    assert set(data["torch_build"]) == {"torch", "accelerator", "could_serve", "other_builds"}
    assert data["selected"] == "cpu_sim"
    by = {b["name"]: b for b in data["backends"]}
    assert {"cpu_sim", "cuda", "ascend"} <= set(by)
    for b in by.values():
        assert set(b) == {"name", "status", "reason", "distribution", "version", "api_version", "priority", "entry_point"}
    assert by["cpu_sim"]["status"] == "ok"
    assert by["cuda"]["status"] == "unavailable" and by["cuda"]["reason"]
    assert by["ascend"]["status"] == "unavailable" and by["ascend"]["reason"]


def test_backends_table_marks_the_selected_backend():
    r = run_cli("backends")
    assert r.returncode == 0
    assert "selected: cpu_sim" in r.stdout
    assert any(line.startswith("*") and "cpu_sim" in line for line in r.stdout.splitlines())


def test_info_json_reports_devices_properties_and_capabilities():
    r = run_cli("info", "--json", env={"CHIPSET_SIM_DEVICES": "3"})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backend"] == "cpu_sim"
    assert info["device_count"] == 3 and len(info["devices"]) == 3
    d = info["devices"][0]
    assert d["total_memory"] > 0 and d["peak_flops"]["float32"] > 0
    assert "float32" in info["capabilities"]["dtypes"]
    assert "rms_norm" in info["kernels"]


def test_unknown_backend_exits_2_and_names_installed_backends():
    r = run_cli("info", env={"CHIPSET_BACKEND": "nosuch"})
    assert r.returncode == 2
    assert "unknown backend 'nosuch'" in r.stderr
    for name in ("cpu_sim", "cuda", "ascend"):
        assert name in r.stderr
    assert "Traceback" not in r.stderr


def test_unavailable_backend_exits_nonzero_with_its_reason():
    r = run_cli("info", env={"CHIPSET_BACKEND": "cuda"})
    assert r.returncode == 2
    assert "not a CUDA build" in r.stderr


def test_malformed_chipset_backend_exits_2():
    r = run_cli("backends", "--json", env={"CHIPSET_BACKEND": "cuda,,"})
    # `backends` still answers (it is the diagnostic), and says why nothing is selected
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["selected"] is None and "malformed" in data["selection_reason"]
    r = run_cli("info", env={"CHIPSET_BACKEND": "cuda,,"})
    assert r.returncode == 2 and "malformed" in r.stderr


def test_unknown_command_and_flag_exit_2_with_valid_choices():
    r = run_cli("frobnicate")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr and "backends" in r.stderr
    r = run_cli("backends", "--nope")
    assert r.returncode == 2 and "--nope" in r.stderr


def test_debug_flag_shows_the_traceback():
    r = run_cli("--debug", "info", env={"CHIPSET_BACKEND": "nosuch"})
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_third_party_import_error_is_shown_while_cpu_sim_stays_usable(site):
    make_plugin(site, "broken", module_prelude="raise ImportError('libvendor.so: cannot open shared object file')")
    r = run_cli("backends", "--json", site=site)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    by = {b["name"]: b for b in data["backends"]}
    assert by["broken"]["status"] == "import-error"
    assert "libvendor.so" in by["broken"]["reason"]
    assert data["selected"] == "cpu_sim"
    assert "isolated" in r.stderr  # warned on stderr
    r = run_cli("info", site=site, env={"CHIPSET_BACKEND": "cpu_sim"})
    assert r.returncode == 0


def test_backends_verbose_prints_plugin_tracebacks(site):
    make_plugin(site, "broken", module_prelude="raise ImportError('boom')")
    r = run_cli("backends", "-v", site=site)
    assert "Traceback" in r.stdout and "ImportError: boom" in r.stdout


def test_version_flag():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("chipset ")


def test_the_command_ends_like_sys_exit_without_the_interpreters_teardown(tmp_path):
    """chipset._process.exit_process (the ``chipset`` command's and torchrun agent's end): an idle
    executor shut down, threads joined, atexit run, output flushed, the status kept (an int, None
    as 0, a message as 1)."""
    script = (
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "from chipset._process import exit_process\n"
        "out = Path(sys.argv[1])\n"
        "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), (out / 'thread').write_text('done'))).start()\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(2)\n"  # idle workers, never shut down (as torch.compile leaves them)
        "pool.submit(lambda: None).result()\n"
        "sys.stdout.write('unflushed')\n"
        "exit_process(eval(sys.argv[2]))\n")
    for code, status in (("3", 3), ("None", 0), ("'bad input'", 1)):
        out = tmp_path / str(status)
        out.mkdir()
        proc = forked_cli.run([sys.executable, "-c", script, str(out), code], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == status, proc.stderr
        assert proc.stdout == "unflushed"
        assert (out / "atexit").read_text() == "ran" and (out / "thread").read_text() == "done"
        assert ("bad input" in proc.stderr) == (status == 1)


def test_importing_chipset_and_asking_the_command_for_help_import_no_torch():
    """chipset's package imports torch on first use of a name that needs it (chipset/__init__.py):
    ``chipset --version`` and ``--help`` answer without it, and every public name still resolves."""
    code = ("import sys\n"
            "import chipset\n"
            "from chipset.cli.main import build_parser\n"
            "build_parser()\n"
            "before = 'torch' in sys.modules\n"
            "missing = [n for n in chipset.__all__ if getattr(chipset, n, None) is None]\n"
            "print(before, missing, 'torch' in sys.modules)\n")
    out = testenv.fresh_python(code)
    assert out.split() == ["False", "[]", "True"], out
