"""The docs site: every page is in the nav, the CLI reference matches the parsers, and
``mkdocs build --strict`` passes when mkdocs is installed (tox -e docs installs it)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import forked_cli
from chipset.cli.main import COMMANDS
from chipset.cli.reference import _help, iter_parsers

ROOT = Path(__file__).resolve().parents[2]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - listed == set(), f"add these pages to mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav lists missing pages: {sorted(listed - pages)}"


def test_cli_reference_covers_every_command_option_and_help_text():
    doc = (ROOT / "docs/cli.md").read_text()
    flat = _norm(doc)
    seen = []
    for line, parser in iter_parsers():
        seen.append(line)
        assert f"## `{line}`" in doc, f"{line} missing from docs/cli.md"
        assert _norm(_help(parser)) in flat, (
            f"docs/cli.md is stale for '{line}': regenerate it with 'python -m chipset.cli.reference --write'"
        )
    assert {f"chipset {c}" for c in COMMANDS} <= set(seen)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings[python] are not installed here; 'tox -e docs' installs them and "
                    "builds the site in strict mode")
def test_the_site_builds_in_strict_mode(tmp_path):
    r = forked_cli.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for page in ("index.html", "cli/index.html", "api/index.html", "writing-a-plugin/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "comm_stats" in api and "chipset_device" in api  # docstrings were rendered
