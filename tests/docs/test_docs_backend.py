"""The backend docs/writing-a-plugin.md §11 shows, copied verbatim from the page and
installed with pip, passes the conformance suite: the page alone is enough to write one.

Each fenced block of that section whose first line is ``# <path>`` is written to that
path; nothing is added. A subset of the groups runs (see ``GROUPS``) to keep this short.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import forked_cli
import testenv

PAGE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"
SECTION = "## 11. "
_BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
# The per-process groups, and one collective check to show the inherited gloo ops run
# across ranks (the collectives session's start is most of this test's time).
KEYWORD = ("test_discovery.py or test_device.py or test_rng.py or test_memory.py or test_dtypes.py "
           "or all_reduce_sum-float32-0")


def files_of_the_section(text: str) -> dict[str, str]:
    """``{path: code}`` of the section's blocks that name their file on the first line."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    out = {}
    for _lang, code in _BLOCK.findall(section):
        first = code.splitlines()[0]
        if re.fullmatch(r"# [\w./-]+\.(py|toml)", first.strip()):
            out[first[2:].strip()] = code
    return out


def test_the_section_names_a_whole_distribution():
    files = files_of_the_section(PAGE.read_text(encoding="utf-8"))
    assert set(files) == {"pyproject.toml", "chipset_acme_host/__init__.py", "chipset_acme_host/backend.py"}


@pytest.mark.multirank  # the collectives check starts ranks
def test_backend_copied_from_the_docs_passes_conformance(tmp_path):
    src = tmp_path / "chipset-acme-host"
    for rel, code in files_of_the_section(PAGE.read_text(encoding="utf-8")).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(code)
    site = tmp_path / "site"
    env = testenv.clean_env()
    r = forked_cli.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    report = tmp_path / "r.json"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "conformance", "--backend", "acme_host",
                        "--json-report", str(report), "-q", "-k", KEYWORD],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    data = json.loads(report.read_text())
    assert data["work_plan"] == [] and data["summary"]["failed"] == data["summary"]["errors"] == 0
    ran = {g for g, row in data["groups"].items() if row["passed"]}
    assert {"device", "rng", "memory", "dtypes", "collectives"} <= ran, data["groups"]

