"""The plugin kit: scaffold a vendor backend distribution (`chipset plugin new`)."""

from __future__ import annotations

import re
from pathlib import Path

from chipset._version import API_VERSION, __version__
from chipset.errors import UsageError
from chipset.plugin_kit import templates

__all__ = ["scaffold"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def scaffold(name: str, directory: Path) -> list[Path]:
    """Write a plugin distribution for backend ``name`` into ``directory``; return the files."""
    if not _NAME.match(name):
        raise UsageError(
            f"plugin name {name!r} is not valid: expected lowercase letters, digits and '_', "
            "starting with a letter (e.g. 'acme_npu')"
        )
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise UsageError(f"{directory} exists and is not empty; choose a new directory so nothing is overwritten")
    pkg = f"chipset_{name}"
    values = {
        "name": name,
        "dist": f"chipset-{name.replace('_', '-')}",
        "pkg": pkg,
        "cls": "".join(part.capitalize() for part in name.split("_")),
        "env": name.upper(),
        "api_major": API_VERSION[0],
        "api_minor": API_VERSION[1],
        "version": __version__,
    }
    files = {
        "pyproject.toml": templates.PYPROJECT,
        f"{pkg}/__init__.py": templates.DESCRIPTOR,
        f"{pkg}/backend.py": templates.BACKEND,
        "tox.ini": templates.TOX,
        "README.md": templates.README,
    }
    written = []
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.format(**values))
        written.append(path)
    return written
