"""The plugin kit: scaffold a vendor backend distribution (`chipset plugin new`)."""

from __future__ import annotations

import re
from pathlib import Path

from chipset._version import API_VERSION, __version__
from chipset.errors import UsageError
from chipset.plugin_kit import templates
from chipset.preflight import check_writable_dir

__all__ = ["scaffold"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def installed_as(name: str) -> str | None:
    """How ``name`` is already in use here (a backend entry point, a distribution, an importable
    package the scaffold would create), or None. Read from metadata: nothing is imported."""
    from importlib import metadata
    from importlib.util import find_spec

    from chipset.discovery.records import ENTRY_POINT_GROUP

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return f"backend {name!r} is installed" + (f" (distribution {dist.metadata['Name']})" if dist else "")
    dist = f"chipset-{name.replace('_', '-')}"
    try:
        metadata.distribution(dist)
        return f"distribution {dist!r} is installed"
    except metadata.PackageNotFoundError:
        pass
    if find_spec(f"chipset_{name}") is not None:
        return f"package 'chipset_{name}' is importable"
    return None


def scaffold(name: str, directory: Path) -> list[Path]:
    """Write a plugin distribution for backend ``name`` into ``directory``; return the files."""
    if not _NAME.match(name):
        raise UsageError(
            f"plugin name {name!r} is not valid: expected lowercase letters, digits and '_', "
            "starting with a letter (e.g. 'acme_npu')"
        )
    clash = installed_as(name)
    if clash:
        raise UsageError(f"plugin name {name!r} is taken: {clash}. A second plugin of that name would shadow it or "
                         "be shadowed; choose another name (e.g. 'acme_npu')")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--dir {str(directory)!r} is a file; expected a new or empty folder for the plugin")
    if directory.exists() and any(directory.iterdir()):
        raise UsageError(f"{directory} exists and is not empty; choose a new directory so nothing is overwritten")
    check_writable_dir(directory, "plugin folder", "--dir")
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
