"""Tokenized training data on disk: ``chipset data prepare`` writes it, ``data.source = "tokens"`` reads it.

A prepared folder holds token shards (raw little-endian ``uint16`` when the vocabulary fits,
else ``uint32``), one document-offset index per shard and ``meta.json`` (format version,
dtype, tokenizer hash, vocabulary size, EOS id, document and token counts). Every document
is followed by the EOS id, so sequences packed across document boundaries stay separated.
nanoGPT-style flat ``.bin`` files (``uint16``, no header) are read as one shard.
"""

from chipset.data.store import FORMAT, TokenStore, open_tokens

__all__ = ["FORMAT", "TokenStore", "open_tokens"]
