"""``chipset conformance`` without pytest installed: a clear message naming the extra, exit 2."""

from __future__ import annotations

import sys

import forked_cli

# Runs the real CLI in a fresh interpreter in which importing pytest fails as it would
# where pytest is not installed (a meta-path finder refusing it, installed before main).
_BLOCKED = """
import sys

class _NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name == "pytest" or name.startswith(("pytest.", "_pytest")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoPytest())
from chipset.cli.main import main
sys.exit(main(["conformance", "--backend", "cpu_sim"]))
"""


def test_conformance_without_pytest_names_the_extra_and_exits_2(tmp_path):
    proc = forked_cli.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs pytest" in proc.stderr and "chipset[conformance]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_conformance_ignores_the_conftest_of_the_directory_it_is_run_from(tmp_path):
    # pytest loads ./test*/conftest.py from the working directory; a vendor's own project
    # conftest (here, one that fails the collection) must not change the suite's verdict.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "def pytest_collection_modifyitems(config, items):\n"
        "    raise RuntimeError('project conftest leaked into the conformance run')\n"
    )
    proc = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "conformance", "--backend", "cpu_sim",
                           "-k", "test_rng"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "leaked" not in proc.stdout
