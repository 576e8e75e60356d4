"""Checks that run before anything is written or launched, so bad input exits 2 with a clear message.

Why a module of its own: the same questions (is this file text? can this folder be written? can
this host back this job?) are asked by ``chipset train``, ``plan``, ``report`` and ``plugin new``,
and each must be answered before the command creates a folder, writes a file or starts a rank.
Every function raises :class:`chipset.errors.UsageError` (exit 2) or returns a list of problems.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import logging
import math
import os
import tempfile
import unicodedata
from pathlib import Path
from typing import Any, get_type_hints

from chipset.errors import UsageError

__all__ = [
    "INT_LIMIT",
    "read_text_file",
    "value_problems",
    "check_writable_dir",
    "check_output_file",
    "check_optional_packages",
    "host_memory_available",
]

log = logging.getLogger(__name__)

INT_LIMIT = 2**63 - 1
"""The largest integer a config key may hold: torch indexes and seeds tensors with int64."""


# --- files ---------------------------------------------------------------------------------


def read_text_file(path: str | Path, what: str, expected: str) -> str:
    """The UTF-8 text of ``path``; UsageError naming ``what`` when it is missing or binary.

    ``expected`` describes the right kind of file (e.g. "a TOML config file"); it goes in the
    message together with what was found, so the user knows which file to pass instead.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise UsageError(f"{what} {str(p)!r} is a folder; expected {expected}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}; expected {expected}, "
                         "check the path") from None
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
        bad = nul
    except UnicodeDecodeError as exc:
        bad = exc.start if nul < 0 else min(nul, exc.start)
    else:
        if nul < 0:
            return text
    raise UsageError(
        f"{what} {str(p)!r} is not a text file: byte 0x{data[bad]:02x} at offset {bad} is not UTF-8 text "
        f"({len(data)} bytes, starting {data[:8]!r}); expected {expected}, pass that file instead"
    )


# --- config values -------------------------------------------------------------------------


def _control_char(text: str) -> tuple[int, str] | None:
    for i, ch in enumerate(text):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return i, ch
    return None


def value_problems(cfg: Any) -> tuple[list[str], set[str]]:
    """Per-value sanity of every key of a dataclass config (sections of dataclasses).

    Every float must be finite, every int within :data:`INT_LIMIT`, every string one line of
    printable text. Returns (problems, keys with a problem) so the caller can skip its own
    range checks of those keys and report each key once.
    """
    problems: list[str] = []
    bad: set[str] = set()
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(obj):
            continue
        types = get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            key, v, typ = f"{section.name}.{f.name}", getattr(obj, f.name), types.get(f.name)
            if typ is float and isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{key} = {v!r}: expected a finite number (default {f.default!r})")
            elif typ is int and isinstance(v, int) and abs(v) > INT_LIMIT:
                problems.append(f"{key} = {v:.3e}: far too large; expected an integer of at most "
                                f"{INT_LIMIT} (int64) and in practice one this host can hold (default {f.default!r})")
            elif typ is str and isinstance(v, str) and (hit := _control_char(v)) is not None:
                i, ch = hit
                problems.append(f"{key} = {v!r}: control character {ch!r} at position {i}; expected one line "
                                "of printable text")
            else:
                continue
            bad.add(key)
    return problems, bad


# --- folders -------------------------------------------------------------------------------


def _probe_write(folder: Path) -> OSError | None:
    """Try to create (and remove) a temporary file in ``folder``: the only test that also holds as root,
    where permission bits do not stop writes but read-only mounts and /proc do."""
    try:
        fd, name = tempfile.mkstemp(prefix=".chipset-write-test-", dir=folder)
    except OSError as exc:
        return exc
    os.close(fd)
    os.unlink(name)
    return None


def check_writable_dir(path: str | Path, what: str, flag: str) -> None:
    """UsageError unless ``path`` is a writable folder or can be created as one; creates nothing.

    Checks: ``path`` is not a file, no ancestor is a file, and the nearest existing folder
    accepts a new file (tested by creating and removing one).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is a file, not a folder; expected a folder to write into. "
                         f"Pass another {flag} (a new or existing folder)")
    existing = p
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing != p and not existing.is_dir():
        raise UsageError(f"{what} {str(p)!r} lies under {str(existing)!r}, which is a file, not a folder; "
                         f"pass another {flag}")
    exc = _probe_write(existing)
    if exc is not None:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason += " (read-only or not yours)"
        raise UsageError(f"{what} {str(p)!r} cannot be written: creating a file in {str(existing)!r} failed: "
                         f"{reason}; pass a {flag} in a writable location")


def check_output_file(path: str | Path, what: str, flag: str) -> None:
    """UsageError unless ``path``'s folder exists and is writable and ``path`` is not a folder."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is a folder; expected a file name, e.g. {str(p / 'report.html')!r}")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{what} {str(p)!r} lies under {str(parent)!r}, which is a file, not a folder; "
                         f"pass another {flag}")
    if not parent.exists():
        raise UsageError(f"{what} {str(p)!r}: its folder {str(parent)!r} does not exist; create it first "
                         f"(mkdir -p {parent}) or pass another {flag}")
    check_writable_dir(parent, f"the folder of {what}", flag)


# --- optional packages ---------------------------------------------------------------------


def _needs(cfg: Any) -> list[tuple[str, str, str, str]]:
    """(config feature, import name, pip name, chipset extra) for each optional package ``cfg`` will import.

    The import names are the ones the code imports lazily (models/hf/weights.py, data/prepare.py,
    data/hf.py, models/resnet.py); the extras are pyproject.toml's [project.optional-dependencies]."""
    m, d = cfg.model, cfg.data
    needs = []
    if m.init_from:
        needs.append((f"model.init_from = {m.init_from!r} (reading its safetensors weights)", "safetensors",
                      "safetensors", "hf"))
    if d.source == "hf":
        needs += [("data.source = 'hf'", "datasets", "datasets", "hf-data"),
                  ("data.source = 'hf' (tokenizing with data.tokenizer)", "tokenizers", "tokenizers", "hf-data")]
    if d.source == "images":
        needs.append(("data.source = 'images' (decoding the images)", "PIL", "pillow", "images"))
    return needs


def check_optional_packages(cfg: Any) -> None:
    """UsageError naming each optional package the run config needs but this Python cannot import.

    Why here: the ranks import these packages only when they load weights or data, after the run
    directory exists, so a missing one used to fail there with one traceback per rank. Importing
    (not just finding) the package also catches one that is installed but broken."""
    problems = []
    for feature, module, pip_name, extra in _needs(cfg):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{feature} needs the '{pip_name}' package, which cannot be imported here ({exc}); "
                            f"install it: pip install 'chipset[{extra}]' (or pip install {pip_name})")
    if problems:
        raise UsageError("\n".join([*problems, "Nothing was written; install the package(s) and run the command again."]))


# --- memory --------------------------------------------------------------------------------


def _cgroup_headroom() -> int | None:
    """Bytes the cgroup (v2) still lets this process group use, when a limit is set."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    if not limit.isdigit() or not used.isdigit():
        return None  # "max": no limit
    return max(0, int(limit) - int(used))


def host_memory_available() -> tuple[int, str] | None:
    """(bytes, where from) of host memory a new job can still use; None when it cannot be told."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
                break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            if pages > 0 and size > 0:
                found.append((pages * size, "free physical pages (sysconf)"))
        except (ValueError, OSError, AttributeError):
            pass
    head = _cgroup_headroom()
    if head is not None:
        found.append((head, "the cgroup's memory.max less memory.current"))
    return min(found) if found else None
