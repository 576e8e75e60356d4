"""Checks of the data keys for Megatron datasets, blends and streams (``data.eos_id``, ``data.blend``,
``data.streaming``, ``data.dataset``), run by config validation before launch and on every rank.

Each message starts with the key it is about and says what was expected, what was found and
what to do (a usage error: exit 2).
"""

from __future__ import annotations

from chipset.data.store import open_tokens
from chipset.errors import ConfigError


def _open(path: str, eos_id: int):
    try:
        return open_tokens(path, eos_id)
    except ConfigError:
        return None  # reported by the path's own check (train/config.py)


def problems(da, vocab_size: int) -> list[str]:
    """Problems of ``da`` (a DataConfig) with the keys above, for ``model.vocab_size`` ``vocab_size``."""
    out: list[str] = []
    if da.eos_id < -1:
        out.append(f"data.eos_id = {da.eos_id!r}: expected a token id >= 0, or -1 to find it in the data")
    elif da.eos_id >= vocab_size > 0:
        out.append(f"data.eos_id = {da.eos_id!r}: not below model.vocab_size ({vocab_size}); give the tokenizer's "
                   "end-of-document id")
    if da.blend and da.source != "tokens":
        out.append(f"data.blend is set but data.source = {da.source!r}; blending mixes token data: set "
                   "data.source = 'tokens' (prepared folders, .bin files, Megatron prefixes)")
    if da.streaming and da.source != "hf":
        out.append(f"data.streaming = true but data.source = {da.source!r}; streaming reads a Hugging Face dataset: "
                   "set data.source = 'hf' (token data is memory-mapped, never loaded whole)")
    if da.dataset and not (da.source == "hf" and da.streaming):
        out.append(f"data.dataset = {da.dataset!r} names a Hub dataset to stream; set data.source = 'hf' and "
                   "data.streaming = true (a copy saved with save_to_disk goes in data.path)")
    if da.source != "tokens":
        if da.eos_id >= 0 and not getattr(da, "document_mask", False):
            out.append(f"data.eos_id = {da.eos_id!r} is for data.source = 'tokens' with Megatron indexed datasets "
                       f"(documents without an end-of-document token) or data.document_mask; data.source = "
                       f"{da.source!r} takes the EOS from its tokenizer: remove data.eos_id")
        return out
    stores = []  # (key, path, store) of every token source the run reads
    if da.blend:
        from chipset.data.blend import parse_blend

        entries, bad = parse_blend(da.blend, da.path)
        out += bad
        for n, (_, path) in enumerate(entries, 1):
            try:
                store = open_tokens(path, da.eos_id)
            except ConfigError as exc:
                out.append(f"data.blend entry {n}: {exc}")
                continue
            stores.append((f"data.blend entry {n}", path, store))
            if store.vocab_size is not None and store.vocab_size > vocab_size:
                out.append(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary "
                           f"({store.vocab_size}, data.blend entry {n}: {path!r}); set --set "
                           f"model.vocab_size={store.vocab_size}")
        out += _mixed_tokenizers(stores)
    elif da.path:
        store = _open(da.path, da.eos_id)
        if store is not None:
            stores.append(("data.path", da.path, store))
    if da.eval_path:
        store = _open(da.eval_path, da.eos_id)
        if store is not None:
            stores.append(("data.eval_path", da.eval_path, store))
    for key, _, store in stores:
        if store.meta.get("problem"):
            msg = store.meta["problem"]
            out.append(msg if key == "data.path" else f"{key}: {msg}")
    if da.eos_id >= 0 and stores and not any(s.meta.get("format") == "megatron-mmidx" for _, _, s in stores):
        out.append(f"data.eos_id = {da.eos_id!r} applies to Megatron indexed datasets (whose documents may lack an "
                   "end-of-document token); prepared folders record their EOS and flat .bin files are read as they "
                   "are: remove data.eos_id")
    return out


def _mixed_tokenizers(stores) -> list[str]:
    """Blend sources whose recorded tokenizer or EOS id differ: the same id would mean different tokens."""
    out = []
    for what, key in (("tokenizer", lambda m: (m.get("tokenizer") or {}).get("sha256")),
                      ("end-of-document id", lambda m: m.get("eos_id"))):
        seen = [(name, path, key(s.meta)) for name, path, s in stores if key(s.meta) is not None]
        if len({v for _, _, v in seen}) > 1:
            listed = "; ".join(f"{name} {path!r}: {str(v)[:16]}" for name, path, v in seen)
            out.append(f"data.blend sources differ in {what} ({listed}); the same token id would mean different "
                       "tokens: prepare every source with the same tokenizer")
            break
    return out
