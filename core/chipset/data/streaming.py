"""``data.source = "hf"`` with ``data.streaming = true``: a corpus read as a stream, tokenized on the fly.

For corpora that do not fit on disk: Hugging Face ``datasets`` streams the records
(``load_dataset(..., streaming=True)``), of local data files (``data.path``: a JSONL, Parquet or
text file, a folder of them or a glob; compressed ``.gz``/``.zst``/... too) or of a Hub dataset
(``data.dataset = "owner/name"`` or ``"owner/name:config"``, split ``train``). The order is
shuffled with ``IterableDataset.shuffle(seed=data.seed, buffer_size=BUFFER_DOCS)`` (shard order
plus a buffer of documents, not a global shuffle), epoch ``e`` with ``seed + e``.

The ``data.field`` text of each record is tokenized with ``data.tokenizer`` and followed by its
EOS id, as ``chipset data prepare`` writes documents, and the resulting token stream is cut into
the same windows as a token folder: sequence ``i`` of the run is tokens ``i*seq_len ..
i*seq_len+seq_len`` of the stream (stream order, no window shuffle). When the stream ends, the
next epoch follows it. Step ``s`` takes sequences ``s*G .. s*G+G-1``, dp rank ``r`` its block.

Deterministic: for the same records, ``data.seed``, tokenizer, ``train.seq_len`` and
``train.global_batch`` (and ``datasets`` version, whose shuffle defines the order), sequence
``i`` is the same in every run and on every layout: each rank reads the whole stream and keeps
its block, so dp sizes agree and a resumed run, at any dp size, sees the tokens of the
uninterrupted one. Costs that buys: every rank tokenizes the whole stream (dp times the
tokenizing of one reader), and a resume re-reads and re-tokenizes the stream from its start up
to the resume step (skipping is by reading; a stream cannot seek). Not deterministic: a Hub
dataset that changes between runs changes the stream.
"""

from __future__ import annotations

import glob
import logging
import time
from pathlib import Path

import numpy as np
import torch

from chipset.data import batching
from chipset.errors import ConfigError

log = logging.getLogger(__name__)

BUFFER_DOCS = 10_000
BATCH_DOCS = 256
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text", ".text": "text"}


def _suffix(f: Path) -> str:
    """``a.jsonl.gz`` -> ``.jsonl``: the format under a compression suffix."""
    s = [x.lower() for x in f.suffixes]
    if s and s[-1] in COMPRESSED:
        s = s[:-1]
    return s[-1] if s else ""


def local_files(path: str) -> tuple[list[str], str]:
    """``(files, datasets builder)`` for ``data.path``: one file, a folder (walked, sorted) or a glob."""
    from chipset.data.prepare import is_hf_dataset

    p = Path(path)
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(path, recursive=True)) if Path(f).is_file()]
    elif is_hf_dataset(p):
        raise ConfigError(f"data.path = {path!r} is a dataset saved with save_to_disk: it is on disk already; "
                          "train on it with data.streaming = false")
    elif p.is_dir():
        files = [f for f in sorted(p.rglob("*")) if f.is_file() and _suffix(f) in BUILDERS]
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"data.path = {path!r}: no such file, folder or glob match; give local data files "
                          "(JSONL, Parquet or text) or stream a Hub dataset with data.dataset")
    if not files:
        raise ConfigError(f"data.path = {path!r} holds no {', '.join(BUILDERS)} files (compressed or not); "
                          "give JSONL, Parquet or text files")
    builders = {BUILDERS.get(_suffix(f)) for f in files}
    if None in builders:
        odd = next(f for f in files if _suffix(f) not in BUILDERS)
        raise ConfigError(f"data.path = {path!r}: {odd} is not JSONL, Parquet or text (by its extension); "
                          f"stream files ending in {', '.join(BUILDERS)}")
    if len(builders) > 1:
        raise ConfigError(f"data.path = {path!r} mixes {' and '.join(sorted(builders))} files; a stream reads one "
                          "format: put each format in its own folder and stream one of them")
    return [str(f) for f in files], builders.pop()


def open_stream(path: str, dataset: str, seed: int, shuffle: bool = True):
    """The ``datasets.IterableDataset`` of the records, shuffled with ``seed`` (epoch via ``set_epoch``)."""
    import datasets

    if dataset:
        name, _, config = dataset.partition(":")
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    else:
        files, builder = local_files(path)
        extra = {"sample_by": "document"} if builder == "text" else {}  # one file, one document (as prepare)
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **extra)
    return ds.shuffle(seed=seed, buffer_size=BUFFER_DOCS) if shuffle else ds


def problems(da) -> list[str]:
    """What keeps ``data.source = "hf"`` with ``data.streaming`` from working (``da``: the DataConfig)."""
    out = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        out.append("data.streaming needs the 'datasets' package: pip install 'chipset[hf-data]' (or pip install datasets)")
    if da.path and da.dataset:
        out.append(f"data.path = {da.path!r} and data.dataset = {da.dataset!r} are both set; a stream reads one: local "
                   "files (data.path) or a Hub dataset (data.dataset)")
    elif not (da.path or da.dataset):
        out.append("data.streaming needs data.path (local JSONL, Parquet or text files, a folder or a glob) or "
                   "data.dataset (a Hugging Face Hub dataset, owner/name or owner/name:config)")
    if da.eval_fraction:
        out.append(f"data.eval_fraction = {da.eval_fraction!r} with data.streaming: a stream has no known end to hold "
                   "out; evaluate on prepared tokens in another run, or prepare the corpus (chipset data prepare)")
    if not da.tokenizer:
        out.append("data.streaming needs data.tokenizer: a tokenizer.json or a model directory holding one")
    elif not (Path(da.tokenizer).is_file() or (Path(da.tokenizer) / "tokenizer.json").is_file()):
        out.append(f"data.tokenizer = {da.tokenizer!r}: no tokenizer.json found; give a tokenizers file or a model "
                   "directory holding one")
    if not da.field:
        out.append("data.field is empty: name the record field holding the text")
    if out or da.dataset:  # a Hub dataset is not fetched to check it: its first batch will say
        return out
    try:
        first = next(iter(open_stream(da.path, "", da.seed, shuffle=False)), None)
    except ConfigError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - datasets' own errors (bad JSON, unreadable file): say which
        return [f"data.path = {da.path!r}: datasets cannot stream it ({type(exc).__name__}: {exc}); give readable "
                "JSONL, Parquet or text files"]
    if first is None:
        return [f"data.path = {da.path!r}: the stream holds no records; give non-empty data files"]
    if not isinstance(first.get(da.field), str):
        return [f"data.field = {da.field!r}: the first record of {da.path!r} has no text field of that name "
                f"(fields: {', '.join(first)}); set data.field to the text field"]
    return []


class StreamingTokens:
    """The tokenized stream of :func:`open_stream`, read forward; ``batch`` as every other source."""

    def __init__(self, path: str, dataset: str, tokenizer: str, field: str, seq_len: int, global_batch: int,
                 seed: int = 0, vocab_size: int | None = None):
        from chipset.data.prepare import _load_tokenizer, find_eos, tokenizer_file

        self.path, self.dataset, self.field = path, dataset, field
        self.seq_len, self.global_batch, self.seed, self.vocab_size = seq_len, global_batch, seed, vocab_size
        self.source = dataset or path
        tok_file = tokenizer_file(tokenizer)
        self.tok = _load_tokenizer(tok_file)
        self.eos = find_eos(self.tok, tok_file, None)
        self._ds = open_stream(path, dataset, seed)
        self._rewind()

    def _rewind(self) -> None:
        self._chunks = self._token_chunks()
        self._buf = np.empty(0, dtype=np.int64)
        self._pos = 0  # stream position of self._buf[0]
        self._fresh = True  # nothing read yet: a first read beyond 0 is a resume's skip
        self.epoch = 0

    def _encode(self, texts: list[str]) -> np.ndarray:
        ids = [e.ids + [self.eos] for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        return np.fromiter((t for doc in ids for t in doc), dtype=np.int64, count=sum(map(len, ids)))

    def _records(self):
        """The records of this epoch; a read error of ``datasets`` (a bad line, a lost file) as a ConfigError."""
        it, n = iter(self._ds), 0
        while True:
            try:
                rec = next(it)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - datasets' and its readers' own types
                raise ConfigError(f"data.source = 'hf' streaming {self.source!r}: reading failed after {n} "
                                  f"records of epoch {self.epoch} ({type(exc).__name__}: {exc}); fix or remove "
                                  "that data (every rank and every resume reads the stream the same way)") from exc
            n += 1
            yield rec

    def _token_chunks(self):
        """Token arrays of ``BATCH_DOCS`` documents each, epoch after epoch."""
        while True:
            self._ds.set_epoch(self.epoch)
            batch, docs = [], 0
            for n, rec in enumerate(self._records()):
                text = rec.get(self.field)
                if not isinstance(text, str):
                    raise ConfigError(f"data.field = {self.field!r}: record {n} of epoch {self.epoch} of "
                                      f"{self.source!r} has no text field of that name (fields: {', '.join(rec)}); "
                                      "set data.field to the text field")
                if text:
                    batch.append(text)
                if len(batch) == BATCH_DOCS:
                    docs += len(batch)
                    yield self._encode(batch)
                    batch = []
            if batch:
                docs += len(batch)
                yield self._encode(batch)
            if not docs:
                raise ConfigError(f"data.source = 'hf' streaming {self.source!r}: epoch {self.epoch} holds no "
                                  f"non-empty {self.field!r} text; check the data and data.field")
            log.info("data.streaming: epoch %d of %s ended after %d documents", self.epoch, self.source, docs)
            self.epoch += 1

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start+length-1`` of the stream. Reads go forward; an earlier start rewinds
        the stream to its beginning (correct, slow)."""
        if start < self._pos:
            log.warning("data.streaming: token %d was requested after the stream moved past it (at %d); "
                        "reading the stream again from its start", start, self._pos)
            self._rewind()
        skipping = self._fresh and start >= self.global_batch * self.seq_len  # a whole step or more
        self._fresh = False
        t0 = time.perf_counter()
        cut = min(start - self._pos, len(self._buf))
        self._buf, self._pos = self._buf[cut:], self._pos + cut
        pieces, have = [self._buf], len(self._buf)
        while self._pos + have < start + length:
            chunk = next(self._chunks)
            if not have and self._pos + len(chunk) <= start:  # before the start: skipped (resume)
                self._pos += len(chunk)
                continue
            if not have and self._pos < start:
                chunk, self._pos = chunk[start - self._pos:], start
            pieces.append(chunk)
            have += len(chunk)
        if skipping:
            log.info("data.streaming: read %d tokens of %s (epoch %d) to reach token %d in %.1f s (a stream is "
                     "read, not seeked, up to the resume point)", start, self.source, self.epoch, start,
                     time.perf_counter() - t0)
        self._buf = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        return self._buf[start - self._pos:start - self._pos + length]

    def sequence(self, index: int) -> torch.Tensor:
        seq = torch.from_numpy(self.read(index * self.seq_len, self.seq_len + 1).copy())
        if self.vocab_size is not None and int(seq.max()) >= self.vocab_size:
            raise ConfigError(f"data.tokenizer produced token id {int(seq.max())} but model.vocab_size is "
                              f"{self.vocab_size}; set model.vocab_size to the tokenizer's vocabulary size")
        return seq

    batch = batching.batch
