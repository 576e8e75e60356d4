"""Importing chipset does not let torch auto-load accelerator extensions.

torch >= 2.5 imports every distribution registered under the ``torch.backends`` entry
point group on ``import torch`` (how torch_npu loads itself). A fake extension, installed
as a real dist-info, proves the mechanism in this torch and that chipset switches it off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def site(tmp_path) -> Path:
    site = tmp_path / "site"
    (site / "fake_accel").mkdir(parents=True)
    (site / "fake_accel" / "__init__.py").write_text("def autoload():\n    pass\n")
    info = site / "fake_accel-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-accel\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nfake_accel = fake_accel:autoload\n")
    return site


def _loaded(site: Path, code: str, **extra: str) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), **extra)
    proc = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('fake_accel' in sys.modules)"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1] == "True"


def test_plain_torch_import_autoloads_the_extension(site):
    assert _loaded(site, "import torch")  # the mechanism chipset guards against is real


def test_importing_chipset_first_keeps_the_extension_out(site):
    assert not _loaded(site, "import chipset, torch")


def test_an_explicit_user_setting_wins(site):
    assert _loaded(site, "import chipset, torch", TORCH_DEVICE_BACKEND_AUTOLOAD="1")
