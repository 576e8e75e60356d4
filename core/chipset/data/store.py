"""Reading token folders, flat ``.bin`` files and Megatron indexed datasets through ``numpy.memmap``
(no copy into memory)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from chipset.errors import ConfigError

FORMAT = "chipset-tokens"
VERSION = 1
META = "meta.json"


class TokenStore:
    """The concatenated token stream of one or more shards, addressed by global position."""

    def __init__(self, shards: list[np.ndarray], meta: dict, source: str):
        self.shards = shards
        self.meta = meta
        self.source = source
        lengths = [len(s) for s in shards]
        self.starts = np.cumsum([0] + lengths)  # shard i covers [starts[i], starts[i+1])
        self.total = int(self.starts[-1])

    @property
    def vocab_size(self) -> int | None:
        return self.meta.get("vocab_size")

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start+length-1`` of the stream (may span shards), as int64."""
        if start < 0 or start + length > self.total:
            raise IndexError(f"tokens {start}..{start + length} outside 0..{self.total}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            off = start + done - int(self.starts[shard])
            take = min(length - done, len(self.shards[shard]) - off)
            out[done:done + take] = self.shards[shard][off:off + take]
            done += take
            shard += 1
        return out


def _bad(path, found: str, fix: str) -> ConfigError:
    return ConfigError(f"data.path = {str(path)!r}: {found}; {fix}")


def open_tokens(path: str | Path, eos_id: int = -1) -> TokenStore:
    """A folder written by ``chipset data prepare``, a flat nanoGPT ``.bin`` file (uint16), or a
    Megatron-LM / MindSpeed indexed dataset (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``; see
    :mod:`chipset.data.megatron`, which ``eos_id`` concerns)."""
    from chipset.data.megatron import DocumentStore, open_megatron, prefix_of

    p = Path(path)
    prefix = prefix_of(p)
    if prefix is not None:
        data, meta, doc_starts = open_megatron(prefix, eos_id, path=p)
        if doc_starts is not None:  # documents without an end-of-document token: EOS inserted on read
            return DocumentStore(data, doc_starts, meta["eos_id"], meta, str(p))
        return TokenStore([data], meta, str(p))
    if p.is_file():
        if p.suffix != ".bin":
            raise _bad(p, "is a file but not a .bin token file",
                       "give a folder made by `chipset data prepare`, a flat uint16 .bin file (nanoGPT style) "
                       "or a Megatron indexed dataset (PREFIX of PREFIX.bin + PREFIX.idx)")
        if p.stat().st_size % 2:
            raise _bad(p, f"has {p.stat().st_size} bytes, not a whole number of uint16 tokens",
                       "a flat .bin file holds little-endian uint16 token ids")
        try:
            arr = np.memmap(p, dtype="<u2", mode="r")
        except (OSError, ValueError) as exc:  # unreadable, or empty (mmap of 0 bytes)
            raise _bad(p, f"cannot be read as tokens ({exc})", "give a readable, non-empty uint16 .bin file") from None
        return TokenStore([arr], {"format": "flat-bin", "dtype": "uint16"}, str(p))
    if not p.is_dir():
        raise _bad(p, "no such file or directory", "run `chipset data prepare INPUTS --tokenizer T --out DIR` first "
                   "(or, for a Megatron indexed dataset, give the PREFIX of PREFIX.bin + PREFIX.idx)")
    meta_path = p / META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise _bad(p, f"has no {META}", "point data.path at a folder written by `chipset data prepare`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(p, f"{META} is unreadable ({exc})", "prepare the folder again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(p, f"{META} is not a {FORMAT} metadata file", "prepare the folder again")
    if meta.get("version") != VERSION:
        raise _bad(p, f"format version {meta.get('version')!r}, this chipset reads version {VERSION}",
                   "prepare the folder again with this chipset")
    dtype = {"uint16": "<u2", "uint32": "<u4"}.get(meta.get("dtype"))
    if dtype is None:
        raise _bad(p, f"dtype {meta.get('dtype')!r} in {META}", "expected uint16 or uint32; prepare it again")
    shards = []
    for s in meta.get("shards", []):
        f = p / s["file"]
        size = f.stat().st_size if f.is_file() else -1
        if size != s["tokens"] * np.dtype(dtype).itemsize:
            raise _bad(p, f"shard {s['file']} has {size} bytes, {META} says {s['tokens']} tokens",
                       "the folder is incomplete or corrupted; prepare it again")
        if s["tokens"]:
            try:
                shards.append(np.memmap(f, dtype=dtype, mode="r"))
            except OSError as exc:
                raise _bad(p, f"shard {s['file']} cannot be read ({exc.strerror or exc})",
                           "make the folder readable by this user") from None
    if not shards:
        raise _bad(p, "holds no tokens", "prepare it from non-empty inputs")
    return TokenStore(shards, meta, str(p))
