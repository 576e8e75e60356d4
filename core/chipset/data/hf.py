"""``data.source = "hf"``: a saved Hugging Face dataset, tokenized once into a cached token folder.

Training never tokenizes on the fly: the dataset is prepared (``chipset data prepare`` with the
dataset folder as its input) into a folder keyed by the dataset's files, the tokenizer's hash and
the text field, and then read like ``data.source = "tokens"``. So exact data resume and dp
sharding are the token pipeline's, and a second run on the same data reuses the cache.
The cache lives in ``$CHIPSET_DATA_CACHE``, else ``$XDG_CACHE_HOME/chipset/tokens``, else
``~/.cache/chipset/tokens``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from chipset.errors import ConfigError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    if os.environ.get("CHIPSET_DATA_CACHE"):
        return Path(os.environ["CHIPSET_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "chipset" / "tokens"


def problems(path: str, tokenizer: str, field: str) -> list[str]:
    """What keeps ``data.source = "hf"`` from working, before anything is prepared."""
    from chipset.data.prepare import is_hf_dataset

    out = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        out.append("data.source = 'hf' needs the 'datasets' package: pip install 'chipset[hf-data]' "
                   "(or pip install datasets)")
    if not path or not is_hf_dataset(Path(path)):
        out.append(f"data.path = {path!r}: expected a folder saved with datasets' save_to_disk "
                   "(it holds state.json or dataset_dict.json); for JSONL or Parquet files run "
                   "`chipset data prepare` and use data.source = 'tokens'")
    if not tokenizer:
        out.append("data.source = 'hf' needs data.tokenizer: a tokenizer.json or a model directory holding one")
    elif not (Path(tokenizer).is_file() or (Path(tokenizer) / "tokenizer.json").is_file()):
        out.append(f"data.tokenizer = {tokenizer!r}: no tokenizer.json found; give a tokenizers file or a "
                   "model directory holding one")
    if not field:
        out.append("data.field is empty: name the dataset column holding the text")
    elif not out:
        from chipset.data.prepare import _load_hf

        try:
            columns = _load_hf(Path(path)).column_names
        except ConfigError as exc:
            return [str(exc)]
        if field not in columns:
            out.append(f"data.field = {field!r}: the dataset at {path!r} has no such column "
                       f"(columns: {', '.join(columns)}); set data.field to the text column")
    return out


def cache_dir(path: str, tokenizer: str, field: str) -> Path:
    """The token folder for this (dataset files, tokenizer, field): a change to any of them is a new key."""
    from chipset.data.prepare import tokenizer_file

    h = hashlib.sha256()
    root = Path(path).resolve()
    h.update(str(root).encode())
    for f in sorted(x for x in root.rglob("*") if x.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(hashlib.sha256(tokenizer_file(tokenizer).read_bytes()).digest())
    h.update(field.encode())
    return cache_root() / f"{root.name}-{h.hexdigest()[:16]}"


def ensure_prepared(path: str, tokenizer: str, field: str) -> Path:
    """The cached token folder of the dataset, tokenizing it first when it is not there yet."""
    from chipset.data.prepare import prepare

    bad = problems(path, tokenizer, field)
    if bad:
        raise ConfigError("\n".join(bad))
    out = cache_dir(path, tokenizer, field)
    if not (out / "meta.json").is_file():
        log.info("data.source = 'hf': tokenizing %s (field %r) into %s", path, field, out)
        try:
            prepare([path], tokenizer, out, field=field)
        except ConfigError:
            if not (out / "meta.json").is_file():  # another process finishing first is fine
                raise
    return out
