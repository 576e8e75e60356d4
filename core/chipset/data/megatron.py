"""Megatron-LM / MindSpeed indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), read as they are.

The format is Megatron's ``MMapIndexedDataset`` (megatron/core/datasets/indexed_dataset.py), the one
``tools/preprocess_data.py`` writes and MindSpeed reads. ``PREFIX.idx``, little-endian::

    b"MMIDIDX\\x00\\x00"        9 bytes, the magic
    version                  uint64, 1
    dtype code               uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count S         uint64
    document count D         uint64 (documents + 1)
    sizes                    S x int32, tokens per sequence
    pointers                 S x int64, byte offset of each sequence in PREFIX.bin
    document indices         D x int64, 0 first; document d is sequences idx[d] .. idx[d+1]-1
    (modes                   S x int8, multimodal datasets only; not read)

``PREFIX.bin`` holds the sequences back to back in that dtype, so the whole file is the token
stream in order. Both files are memory-mapped; nothing is converted or copied.

Document boundaries: chipset's token folders end every document with the EOS id, and packing
relies on it. Data preprocessed with ``--append-eod`` (the GPT default) already does: the last
token of every document is the same id, found by looking at up to :data:`SAMPLE_DOCS` documents
spread over the file, and the ``.bin`` is read as it is. Data without it has no separator
between documents; ``data.eos_id`` then names the id to insert after every document (a virtual
stream: the insertion happens at read time, from the document offsets held in memory, 8 bytes
per document).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from chipset.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # Megatron/fairseq's older non-mmap IndexedDataset
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
SAMPLE_DOCS = 10_000
FORMAT = "megatron-mmidx"


def _bad(path, found: str, fix: str) -> ConfigError:
    return ConfigError(f"data.path = {str(path)!r}: {found}; {fix}")


def prefix_of(path: str | Path) -> Path | None:
    """The Megatron ``PREFIX`` that ``path`` names, or None when it is not one.

    ``PREFIX.idx``, ``PREFIX.bin`` with a ``PREFIX.idx`` beside it, or ``PREFIX`` itself when no
    file or folder has that name and ``PREFIX.bin`` or ``PREFIX.idx`` exists. A ``.bin`` file
    alone stays a flat nanoGPT file."""
    p = Path(path)
    if p.suffix == ".idx" and not p.is_dir():
        return p.with_suffix("")
    if p.suffix == ".bin" and p.is_file():
        return p.with_suffix("") if p.with_suffix(".idx").exists() else None
    if not p.exists() and (_with(p, ".bin").exists() or _with(p, ".idx").exists()):
        return p
    return None


def _with(prefix: Path, suffix: str) -> Path:
    return prefix.with_name(prefix.name + suffix)


class DocumentStore:
    """A token stream with ``eos`` inserted after every document: documents ``d`` of ``data`` are
    tokens ``starts[d] .. starts[d+1]-1``; the stream is document 0, eos, document 1, eos, ...

    Same interface as :class:`chipset.data.store.TokenStore` (``total``, ``read``, ``meta``)."""

    def __init__(self, data: np.ndarray, starts: np.ndarray, eos: int, meta: dict, source: str):
        self.shards = [data]
        self.data, self.meta, self.source, self.eos = data, meta, source, eos
        self.doc_starts = starts  # len documents + 1, the last = len(data)
        self.vstarts = starts + np.arange(len(starts), dtype=np.int64)  # document d's place in the stream
        self.total = int(self.vstarts[-1])

    @property
    def vocab_size(self) -> int | None:
        return self.meta.get("vocab_size")

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.total:
            raise IndexError(f"tokens {start}..{start + length} outside 0..{self.total}")
        pos = np.arange(start, start + length, dtype=np.int64)
        doc = np.searchsorted(self.vstarts, pos, side="right") - 1
        off = pos - self.vstarts[doc]
        is_eos = off == self.doc_starts[doc + 1] - self.doc_starts[doc]
        out = np.full(length, self.eos, dtype=np.int64)
        keep = ~is_eos
        out[keep] = self.data[(self.doc_starts[doc] + off)[keep]]
        return out


def open_megatron(prefix: Path, eos_id: int = -1, path: str | Path | None = None):
    """``(tokens, meta, document starts or None)`` of ``PREFIX.bin``/``PREFIX.idx``: the memory-mapped
    ``.bin``, its metadata and, when an EOS id is to be inserted after every document, the
    document offsets for :class:`DocumentStore` (``chipset.data.store.open_tokens`` builds the store).

    ``eos_id`` (``data.eos_id``): -1 finds it (the id every sampled document ends with); an id
    that the documents do not end with is inserted after each one. When neither works,
    ``meta["problem"]`` says so (raised by the dataset, reported by validation)."""
    shown = path if path is not None else prefix
    idx, binf = _with(prefix, ".idx"), _with(prefix, ".bin")
    fix_pair = ("a Megatron indexed dataset is PREFIX.bin + PREFIX.idx from tools/preprocess_data.py; "
                "set data.path to PREFIX and keep both files together")
    for f, other in ((idx, binf), (binf, idx)):
        if not f.is_file():
            found = f"{f.name} is missing" + (f" (found {other.name})" if other.is_file() else "")
            extra = (" If " + binf.name + " is a flat nanoGPT token file, set data.path to it"
                     if f is idx and binf.is_file() else "")
            raise _bad(shown, found, fix_pair + "." + extra)
    try:
        with open(idx, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        idx_size, bin_size = idx.stat().st_size, binf.stat().st_size
    except OSError as exc:
        raise _bad(shown, f"cannot read {exc.filename or idx}: {exc.strerror or exc}",
                   "make the files readable by this user") from None
    if head[:len(MAGIC)] != MAGIC:
        what = (" (Megatron's older non-mmap IndexedDataset; rewrite it with the current "
                "tools/preprocess_data.py, which writes MMIDIDX)" if head.startswith(LEGACY_MAGIC) else "")
        raise _bad(shown, f"{idx.name} starts with {head[:len(MAGIC)]!r}{what}, expected the Megatron index magic "
                   f"{MAGIC!r}", "give the .idx written with its .bin by Megatron-LM or MindSpeed preprocessing"
                   + (f"; if {binf.name} is a flat nanoGPT token file, move {idx.name} away or set data.path "
                      f"to {binf}" if path is not None and Path(path).suffix == ".bin" else ""))
    if len(head) < HEADER_BYTES:
        raise _bad(shown, f"{idx.name} has {idx_size} bytes, shorter than the {HEADER_BYTES}-byte header",
                   "the file is truncated; copy or preprocess it again")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != 1:
        raise _bad(shown, f"{idx.name} is index version {version}, chipset reads version 1",
                   "write it with a Megatron-LM / MindSpeed version whose index version is 1")
    dtype = DTYPES.get(code)
    if dtype is None or dtype.startswith("float"):
        raise _bad(shown, f"{idx.name} declares dtype code {code} ({dtype or 'unknown'})",
                   f"expected token ids of an integer dtype (codes {', '.join(f'{c} {n}' for c, n in DTYPES.items() if 'float' not in n)})")
    need = HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size not in (need, need + n_seq):
        raise _bad(shown, f"{idx.name} has {idx_size} bytes, its header ({n_seq} sequences, {n_doc} document "
                   f"indices) needs {need}", "the index is truncated or not a Megatron index; preprocess the data again")
    item = np.dtype(dtype).itemsize
    try:
        index = np.memmap(idx, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise _bad(shown, f"cannot map {idx.name}: {exc.strerror or exc}", "make the file readable by this user") from None
    sizes = np.frombuffer(index, dtype="<i4", count=n_seq, offset=HEADER_BYTES)
    pointers = np.frombuffer(index, dtype="<i8", count=n_seq, offset=HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(index, dtype="<i8", count=n_doc, offset=HEADER_BYTES + 12 * n_seq)
    end = int(pointers[-1]) + int(sizes[-1]) * item if n_seq else 0
    if n_seq and (int(pointers[0]) != 0 or end != bin_size):
        raise _bad(shown, f"{binf.name} has {bin_size} bytes but {idx.name} places its sequences at bytes "
                   f"{int(pointers[0])}..{end}", "the two files are from different runs or one is truncated; "
                   "copy both again from the same preprocessing run")
    if n_doc < 1 or int(docs[0]) != 0 or int(docs[-1]) != n_seq:
        raise _bad(shown, f"{idx.name}'s document indices run {int(docs[0]) if n_doc else '-'}.."
                   f"{int(docs[-1]) if n_doc else '-'}, expected 0..{n_seq} (the sequence count)",
                   "the index is corrupted; preprocess the data again")
    if bin_size == 0:
        raise _bad(shown, f"{binf.name} holds no tokens", "preprocess non-empty inputs")
    if bin_size % item:
        raise _bad(shown, f"{binf.name} has {bin_size} bytes, not a whole number of {dtype} tokens",
                   "the file is truncated; copy it again")
    try:
        data = np.memmap(binf, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    except OSError as exc:
        raise _bad(shown, f"cannot map {binf.name}: {exc.strerror or exc}", "make the file readable by this user") from None
    documents = n_doc - 1
    meta = {"format": FORMAT, "dtype": dtype, "documents": documents, "sequences": n_seq}
    # The last token of documents spread over the file (at most SAMPLE_DOCS: each read may touch a page).
    sample = np.unique(np.linspace(0, documents - 1, min(documents, SAMPLE_DOCS)).astype(np.int64))
    last_seq = docs[sample + 1] - 1
    nonempty = (docs[sample + 1] > docs[sample]) & (sizes[np.maximum(last_seq, 0)] > 0)
    ends = np.full(len(sample), -1, dtype=np.int64)
    where = last_seq[nonempty]
    ends[nonempty] = data[pointers[where] // item + sizes[where] - 1]
    common = int(ends[0]) if len(ends) and (ends == ends[0]).all() and ends[0] >= 0 else None
    checked = f"{len(sample)} of {documents} document(s)"
    if (eos_id < 0 and common is not None) or (eos_id >= 0 and common == eos_id):
        meta.update(eos_id=common, eod="in data", eod_checked=checked)
        return data, meta, None
    if eos_id >= 0:
        starts = np.append(pointers // item, bin_size // item)[docs].astype(np.int64)
        meta.update(eos_id=eos_id, eod="inserted", eod_checked=checked)
        return data, meta, starts
    found = ", ".join(str(int(e)) for e in np.unique(ends[ends >= 0])[:6])
    meta["problem"] = (
        f"data.path = {str(shown)!r}: a Megatron dataset whose documents do not all end with the same token "
        f"(last tokens of {checked}: {found}{', ...' if len(np.unique(ends)) > 6 else ''}), so it was "
        "preprocessed without --append-eod and nothing separates its documents; set data.eos_id to the "
        "tokenizer's end-of-document id and chipset inserts it after every document")
    return data, meta, None
