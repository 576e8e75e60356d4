"""``chipset conformance`` without pytest installed: a clear message naming the extra, exit 2."""

from __future__ import annotations

import subprocess
import sys

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
    proc = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs pytest" in proc.stderr and "chipset[conformance]" in proc.stderr
    assert "Traceback" not in proc.stderr
