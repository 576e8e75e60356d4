"""Checkpoint directories on disk: atomic commit, manifest, verification, selection, pruning.

Layout of a run directory::

    checkpoints/step-00000008/         a complete checkpoint (visible only once committed)
        .metadata  __0_0.distcp ...    torch.distributed.checkpoint files (one set per rank)
        state.json                     step, loss scaler, data position, config, shapes
        manifest.json                  written last: every file's size and SHA-256
    checkpoints/.tmp-step-00000012-*/  a save in progress (or one a crash interrupted)

A save writes everything under ``.tmp-...``, rank 0 writes ``manifest.json`` last and
renames the folder to ``step-N``; until that rename nothing is visible, so a crash
mid-save leaves the previous checkpoint as the newest. Reading never unpickles
arbitrary objects: DCP's ``.metadata`` is read with an allow-list unpickler and tensors
with ``torch.load(weights_only=True)`` (DCP's own reader).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHECKPOINTS", "MANIFEST", "STATE", "Candidate", "checkpoint_dir", "list_checkpoints", "verify",
    "select", "commit", "prune", "run_id_of", "of_run", "remove_partials", "safe_reader", "file_sha256",
]

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
FORMAT = "chipset-checkpoint/1"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, final: Path, step: int, sums: dict[str, dict], extra: dict) -> None:
    """Write the manifest last, then make ``tmp`` visible as ``final`` in one rename."""
    manifest = {"format": FORMAT, "step": step, "created_unix": time.time(), "files": sums, **extra}
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step (a run restarted with --resume none): swap, then drop
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def hash_files(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": file_sha256(folder / n)} for n in names}


@dataclass
class Candidate:
    path: Path
    step: int


def list_checkpoints(run_dir: str | Path) -> list[Candidate]:
    """Committed checkpoint folders of a run, newest first (not yet verified)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append(Candidate(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step, reverse=True)


def verify(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint whose files match the manifest, else why not."""
    mf = path / MANIFEST
    if not mf.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    if manifest.get("format") != FORMAT:
        return f"unknown format {manifest.get('format')!r} (expected {FORMAT!r})"
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files (a complete checkpoint lists every file it holds)"
    if STATE not in files:  # rank 0 writes it into every checkpoint
        return f"{MANIFEST} does not list {STATE} (every complete checkpoint has one)"
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
        if file_sha256(f) != want["sha256"]:
            return f"{name} fails its SHA-256 checksum"
    return None


def run_id_of(path: Path) -> str | None:
    """The run id a checkpoint's manifest records (None: unreadable, or written before run ids)."""
    try:
        rid = json.loads((path / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def of_run(cands: list[Candidate], run_id: str | None) -> list[Candidate]:
    """Only the checkpoints of run ``run_id`` (all of them when ``run_id`` is None)."""
    return cands if run_id is None else [c for c in cands if run_id_of(c.path) == run_id]


def select(run_dir: str | Path, run_id: str | None = None) -> tuple[Candidate | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``run_dir`` and the newer ones skipped, with reasons.

    ``run_id``: consider only that run's checkpoints (an earlier run's never take over).
    """
    skipped = []
    for c in of_run(list_checkpoints(run_dir), run_id):
        why = verify(c.path)
        if why is None:
            return c, skipped
        skipped.append((c.path, why))
    return None, skipped


def prune(run_dir: str | Path, keep: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (0 keeps all); returns what was removed.

    ``run_id``: count and delete only that run's checkpoints (never another run's).
    """
    if keep <= 0:
        return []
    complete = [c for c in of_run(list_checkpoints(run_dir), run_id) if (c.path / MANIFEST).is_file()]
    removed = []
    for c in complete[keep:]:
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.path)
    return removed


def remove_partials(run_dir: str | Path) -> list[Path]:
    """Delete ``.tmp-*`` folders left by interrupted saves (call only when no save is running)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    gone = []
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


# --- reading DCP metadata without executing pickled code ----------------------------------

# Exactly the classes a DCP ``.metadata`` pickle needs (torch 2.13): the metadata dataclasses,
# the storage-info record, tensor sizes/dtypes and a few builtin containers.  Names are matched
# whole; a dotted name (protocol 4 resolves ``a.b`` as an attribute path, e.g. ``os.system``
# reached through an allowed module) is always refused.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to torch.strided etc.
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


def _enum_member(cls, name):
    """``getattr`` as some Python 3.11 releases pickle an enum member (3.11.2 does), and nothing more.

    Why: those versions write ``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`` as
    ``getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")``; a general ``getattr`` would hand a
    crafted file any attribute of an allowed class (``PosixPath.unlink``) to call next."""
    allowed = (isinstance(cls, type) and issubclass(cls, enum.Enum)
               and cls.__qualname__ in _ALLOWED.get(cls.__module__, ()))
    if not allowed or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(
            f"checkpoint metadata asks for attribute {name!r} of {cls!r}; only a member of an allowed "
            "enum may be read that way (the file is not a chipset/DCP checkpoint or was tampered with)"
        )
    return cls.__members__[name]


class _SafeUnpickler(pickle.Unpickler):
    """Why: ``.metadata`` comes from disk and a crafted one must never run code on any rank."""

    def find_class(self, module: str, name: str):
        import torch

        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if "." not in name:
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if name in _ALLOWED.get(module, ()):
                return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not on chipset's allow-list; "
            "refusing to execute it (the file is not a chipset/DCP checkpoint or was tampered with)"
        )


def safe_reader(path: Path):
    """A DCP FileSystemReader whose ``.metadata`` is read with an allow-list unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            # The file name DCP writes (a per-rank name only when asked for one); spelled out
            # here because FileSystemReader's helper for it is private and absent in torch 2.8.
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(Path(self.path) / name, "rb") as f:
                metadata = _SafeUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(str(path))
