"""``chipset data prepare``: text, JSONL and Parquet documents -> token shards, in worker processes.

Documents are read in order, tokenized in batches by a pool of worker processes (each loads
the Hugging Face ``tokenizers`` tokenizer once), and written in the same order, each
followed by the EOS id. The output is assembled in a temporary folder beside ``out`` and
renamed into place only when complete, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from chipset.data.store import FORMAT, META, VERSION
from chipset.errors import ConfigError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
INPUT_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
BATCH_DOCS = 256


def usage(found: str, fix: str) -> ConfigError:
    return ConfigError(f"chipset data prepare: {found}; {fix}")


def tokenizer_file(path: str | Path) -> Path:
    """``tokenizer.json`` itself, or the one inside a model directory."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise usage(f"--tokenizer {str(path)!r}: no tokenizer.json found",
                    "give a Hugging Face tokenizers file (tokenizer.json) or a model directory holding one")
    return f


def _load_tokenizer(f: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise usage("the 'tokenizers' package is not installed", "pip install 'chipset[data]' (or pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:  # tokenizers raises its own Exception type on a bad file
        raise usage(f"{str(f)!r} is not a tokenizers file ({exc})", "give the tokenizer.json of a model") from None


def find_eos(tok, tok_file: Path, eos_token: str | None) -> int:
    """The EOS id: ``--eos-token``, else the model directory's tokenizer_config.json, else a common name."""
    names = [eos_token] if eos_token else []
    cfg = tok_file.parent / "tokenizer_config.json"
    if not eos_token and cfg.is_file():
        try:
            value = json.loads(cfg.read_text()).get("eos_token")
            names.append(value.get("content") if isinstance(value, dict) else value)
        except (OSError, ValueError, AttributeError):
            pass
    if not eos_token:
        names += EOS_CANDIDATES
    for name in names:
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            return int(tok.token_to_id(name))
    if eos_token:
        raise usage(f"--eos-token {eos_token!r} is not in the tokenizer's vocabulary",
                    "give a token the tokenizer knows, e.g. </s> or <|endoftext|>")
    raise usage(f"no end-of-document token found in {str(tok_file)!r} (tried {', '.join(EOS_CANDIDATES)})",
                "name it with --eos-token TOKEN")


HF_MARKERS = ("dataset_dict.json", "state.json")


def is_hf_dataset(p: Path) -> bool:
    """A folder written by ``datasets`` ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return p.is_dir() and any((p / m).is_file() for m in HF_MARKERS)


def _load_hf(path: Path):
    """The saved Hugging Face dataset at ``path``; a DatasetDict contributes its ``train`` split."""
    try:
        import datasets
    except ImportError:
        raise usage(f"{str(path)!r} is a Hugging Face datasets folder but the 'datasets' package is not installed",
                    "pip install 'chipset[hf-data]' (or pip install datasets)") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise usage(f"{str(path)!r} is a DatasetDict without a 'train' split (splits: {', '.join(ds)})",
                        "save the split to train on with Dataset.save_to_disk and give that folder")
        ds = ds["train"]
    return ds


def _input_bytes(f: Path) -> int:
    return sum(x.stat().st_size for x in f.rglob("*") if x.is_file()) if f.is_dir() else f.stat().st_size


def parse_extensions(text: str) -> tuple[str, ...]:
    """``--ext .py,md,.txt`` -> ``('.py', '.md', '.txt')``: the suffixes taken from folders."""
    exts = tuple(dict.fromkeys("." + e.strip().lstrip(".").lower() for e in text.split(",") if e.strip().lstrip(".")))
    if not exts:
        raise usage(f"--ext {text!r} names no extension",
                    f"give a comma-separated list, e.g. --ext {','.join(INPUT_SUFFIXES)},.py")
    return exts


def _looks_binary(f: Path) -> bool:
    with open(f, "rb") as fh:
        return b"\0" in fh.read(8192)


def input_files(inputs: list[str], extensions: tuple[str, ...] = INPUT_SUFFIXES) -> tuple[list[Path], dict[str, int]]:
    """Every input file, folders walked in sorted order, and how many folder files were skipped per suffix.

    Folders contribute the files whose suffix is in ``extensions``; the others are counted, not
    read, so the caller can say what was left out (a corpus of code is mostly ``.py``). A file named
    on its own is always read, as text unless it is JSONL or Parquet: naming it is the choice.
    A folder saved by ``datasets`` (``save_to_disk``) is one input, read through ``datasets``."""
    files: list[Path] = []
    skipped: dict[str, int] = {}
    for item in inputs:
        p = Path(item)
        if is_hf_dataset(p):
            files.append(p)
        elif p.is_dir():
            found, other = [], {}
            for f in sorted(f for f in p.rglob("*") if f.is_file()):
                if f.suffix.lower() in extensions:
                    found.append(f)
                else:
                    key = f.suffix.lower() or "(no extension)"
                    other[key] = other.get(key, 0) + 1
            if not found:
                raise usage(f"folder {item!r} holds no {','.join(extensions)} files"
                            + (f" (it holds {_counts(other)})" if other else ""),
                            "choose the extensions to read with --ext, e.g. --ext .txt,.md,.py")
            files += found
            for key, n in other.items():
                skipped[key] = skipped.get(key, 0) + n
        elif p.is_file():
            if p.suffix.lower() not in INPUT_SUFFIXES and _looks_binary(p):
                raise usage(f"input {item!r} is not text (it holds NUL bytes)",
                            "give text, JSONL or Parquet files (a nanoGPT .bin token file needs no preparing: "
                            "train on it with data.source = 'tokens')")
            files.append(p)
        else:
            raise usage(f"input {item!r} does not exist", "give existing files or folders")
    return files, skipped


def _counts(by_ext: dict[str, int]) -> str:
    """``.py: 260, .cfg: 3``, most files first."""
    return ", ".join(f"{k}: {n}" for k, n in sorted(by_ext.items(), key=lambda kv: (-kv[1], kv[0])))


def skip_summary(skipped: dict[str, int], extensions: tuple[str, ...]) -> str:
    """The line that says which folder files were left out, and how to include them."""
    wanted = [k for k in sorted(skipped, key=lambda k: -skipped[k]) if k.startswith(".")][:1]
    return (f"skipped {sum(skipped.values())} file(s) in input folders by extension ({_counts(skipped)}); "
            f"read only {','.join(extensions)}; to read other extensions list them all with --ext, "
            f"e.g. --ext {','.join([*extensions, *wanted])}")


def documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one input: a whole text file, each JSONL record's ``field``, a Parquet column,
    a saved Hugging Face dataset's ``field`` column."""
    if path.is_dir():
        ds = _load_hf(path)
        if field not in ds.column_names:
            raise usage(f"{path} has no column {field!r} (columns: {', '.join(ds.column_names)})",
                        "choose the text column with --field NAME")
        for batch in ds.select_columns([field]).iter(batch_size=BATCH_DOCS):
            yield from (t for t in batch[field] if t)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise usage(f"{path}:{n} is not JSON ({exc.msg})", "give one JSON object per line") from None
                if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                    raise usage(f"{path}:{n} has no string field {field!r} (keys: {', '.join(rec) if isinstance(rec, dict) else type(rec).__name__})",
                                "choose the text field with --field NAME")
                yield rec[field]
    elif path.suffix.lower() in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise usage(f"reading {path} needs pyarrow", "pip install 'chipset[data]' (or pip install pyarrow)") from None
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise usage(f"{path} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})",
                        "choose the text column with --field NAME")
        for batch in pf.iter_batches(columns=[field]):
            yield from (t for t in batch.column(0).to_pylist() if t)
    else:  # .txt, .md, or any extension the user chose to read: one document per file
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text


_worker_tok = None


def _init_worker(tok_file: str) -> None:
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_tok = _load_tokenizer(Path(tok_file))


def _encode(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in _worker_tok.encode_batch(texts, add_special_tokens=False)]


def _batches(files: list[Path], field: str, progress) -> Iterator[list[str]]:
    batch: list[str] = []
    for f in files:
        for doc in documents(f, field):
            batch.append(doc)
            if len(batch) == BATCH_DOCS:
                yield batch
                batch = []
        progress(f)
    if batch:
        yield batch


class _ShardWriter:
    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._open()

    def _open(self) -> None:
        name = f"shard-{len(self.shards):05d}"
        self.name, self.fh, self.tokens, self.offsets = name, open(self.folder / f"{name}.bin", "wb"), 0, []

    def _close(self) -> None:
        self.fh.close()
        np.save(self.folder / f"{self.name}.idx.npy", np.asarray(self.offsets, dtype=np.int64))
        self.shards.append({"file": f"{self.name}.bin", "index": f"{self.name}.idx.npy",
                            "tokens": self.tokens, "documents": len(self.offsets)})

    def add(self, ids: list[int], eos: int) -> None:
        if self.tokens >= self.shard_tokens:
            self._close()
            self._open()
        self.offsets.append(self.tokens)
        arr = np.asarray(ids + [eos], dtype=self.dtype)
        self.fh.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.tokens += len(arr)

    def finish(self) -> list[dict]:
        self._close()
        return [s for s in self.shards if s["tokens"]] or self.shards[:1]


def _progress_reporter(files: list[Path]):
    """A callback advanced per finished input file: a rich bar on a terminal, else a log line every 5 s."""
    total = sum(_input_bytes(f) for f in files) or 1
    state = {"done": 0, "last": time.monotonic()}
    if sys.stderr.isatty():
        try:
            from rich.progress import Progress

            bar = Progress(transient=False)
            bar.start()
            task = bar.add_task("tokenizing", total=total)

            def advance(f: Path | None):
                if f is None:
                    bar.stop()
                    return
                bar.advance(task, _input_bytes(f))
            return advance
        except ImportError:
            pass

    def plain(f: Path | None):
        if f is None:
            return
        state["done"] += _input_bytes(f)
        if time.monotonic() - state["last"] >= 5:
            state["last"] = time.monotonic()
            log.info("%5.1f%% of input bytes tokenized", 100 * state["done"] / total)
    return plain


def prepare(inputs: list[str], tokenizer: str, out: str | Path, *, field: str = "text", workers: int = 0,
            shard_tokens: int = 100_000_000, eos_token: str | None = None,
            extensions: tuple[str, ...] = INPUT_SUFFIXES) -> dict:
    """Tokenize ``inputs`` into the token folder ``out``; returns its metadata.

    ``extensions``: the suffixes read from folders (``.jsonl``/``.json`` as JSONL, ``.parquet`` as
    Parquet, any other as text); skipped files are summarised in a warning before tokenizing."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise usage(f"--out {str(out)!r} already exists and is not an empty folder",
                    "choose a new folder (prepared data is never overwritten)")
    if shard_tokens <= 0:
        raise usage(f"--shard-tokens {shard_tokens}", "expected a positive number of tokens per shard")
    files, skipped = input_files(inputs, extensions)
    if skipped:
        log.warning(skip_summary(skipped, extensions))
    tok_file = tokenizer_file(tokenizer)
    tok = _load_tokenizer(tok_file)
    eos = find_eos(tok, tok_file, eos_token)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    progress = _progress_reporter(files)
    try:
        writer = _ShardWriter(tmp, dtype, shard_tokens)
        docs = tokens = 0
        batches = _batches(files, field, progress)
        if workers == 1:
            _init_worker(str(tok_file))
            encoded = map(_encode, batches)
            pool = None
        else:
            ctx = multiprocessing.get_context("spawn")  # the tokenizer's threads do not survive fork
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(tok_file),))
            encoded = pool.imap(_encode, batches)
        try:
            for ids_list in encoded:
                for ids in ids_list:
                    writer.add(ids, eos)
                    docs += 1
                    tokens += len(ids) + 1
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        shards = writer.finish()
        if not docs:
            raise usage("the inputs hold no documents", "check the inputs and --field")
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab, "eos_id": eos,
                "documents": docs, "tokens": tokens, "shards": shards,
                "tokenizer": {"file": str(tok_file.resolve()),
                              "sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest()},
                "inputs": [str(f) for f in files], "field": field}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress(None)
    log.info("prepared %d documents, %d tokens into %s", docs, tokens, out)
    return meta
