"""Deterministic language-modelling data (no downloads): synthetic tokens or local text as bytes.

Sequence ``i`` of the stream depends only on ``(seed, i)``: a seeded random walk through a
fixed permutation of the vocabulary with 10% random jumps, so a model can learn it (the
loss falls visibly within a few dozen steps) and every layout sees identical tokens.

Sharding: the global batch of step ``s`` is sequences ``s*G .. s*G+G-1``; data-parallel
rank ``r`` takes the contiguous ``G/dp`` block starting at ``r*G/dp`` and splits it into
micro-batches in order. Any dp x micro_batches split therefore covers the same global
batch as a single process.
"""

from __future__ import annotations

import logging
import os
import struct
import sysconfig
from pathlib import Path

import torch

from chipset.data import batching
from chipset.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["SyntheticTokens", "TextBytes", "TokenFiles", "make_dataset", "make_eval_dataset", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


HELD_OUT_OFFSET = 1 << 30
"""First sample index of synthetic held-out data. torch's CPU generator keeps the low 32 bits of
a seed (``manual_seed(2**40)`` draws what ``manual_seed(0)`` draws), so the offset stays below
2**32: held-out sample ``i`` is training sample ``2**30 + i``, which no run of fewer than 2**30
samples reaches."""


class SyntheticTokens:
    """A seeded token stream; ``batch(step, dp_rank, dp, micro, micro_batches)`` -> (tokens, targets)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int = 0, jump: float = 0.1,
                 offset: int = 0):
        self.offset = offset  # evaluation reads the same walk from indices no training step reaches
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.jump = jump
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        self.perm = torch.randperm(vocab_size, generator=g)
        self._perm_list = self.perm.tolist()
        self._jump32 = struct.unpack("f", struct.pack("f", jump))[0]

    def sequence(self, index: int) -> torch.Tensor:
        """Sequence ``index`` of the stream: ``seq_len + 1`` token ids (int64)."""
        return torch.tensor(self.token_ids(index), dtype=torch.long)

    def token_ids(self, index: int) -> list[int]:
        """Sequence ``index`` as a list of ints (``batching.batch`` makes one tensor of a
        micro-batch's lists: one op instead of one per sequence and a stack)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
        n = self.seq_len + 1
        cur = torch.randint(self.vocab_size, (1,), generator=g).tolist()[0]
        draws = torch.rand(n, generator=g)
        jump = self._jump32 if draws.dtype == torch.float32 else self.jump
        draws = draws.tolist()
        rand = torch.randint(self.vocab_size, (n,), generator=g).tolist()
        # The walk in Python lists: indexing tensors element by element costs a few tensor
        # ops per token, each one a traced op under the simulator's accounting. Float32 draws
        # are compared with the jump probability rounded to float32 (``_jump32``): ``<`` on
        # the Python floats then decides as torch's float32 ``rand < jump`` does.
        perm = self._perm_list
        out = []
        append = out.append
        for r, d in zip(rand, draws, strict=True):
            cur = r if d < jump else perm[cur]
            append(cur)
        return out

    batch = batching.batch  # the contract of the module docstring (data/batching.py)


class TextBytes:
    """Byte-level language modelling over real local text (token id = byte value, vocab 256).

    ``path``: a file, or a directory whose text files (``TEXT_SUFFIXES``) are read in sorted
    order; empty means the Python standard library's sources, present on every install.
    At most ``max_bytes`` are read. Sequence ``i`` starts at an offset drawn from
    ``(seed, i)``, so every rank and layout sees the same global batch.
    """

    VOCAB = 256

    def __init__(self, path: str, seq_len: int, global_batch: int, seed: int = 0, max_bytes: int = 1 << 20):
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
        self.source = str(root)
        data = bytearray()
        if root.is_file():
            data += root.read_bytes()[:max_bytes]
        elif root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if not name.endswith(TEXT_SUFFIXES):
                        continue
                    try:
                        data += Path(dirpath, name).read_bytes() + b"\n"
                    except OSError:
                        continue
                    if len(data) >= max_bytes:
                        break
                if len(data) >= max_bytes:
                    break
        else:
            raise ConfigError(f"data.path = {path!r}: no such file or directory; give a text file or a folder of them")
        if len(data) < seq_len + 2:
            raise ConfigError(
                f"data.path = {self.source!r} holds {len(data)} bytes of text ({', '.join(TEXT_SUFFIXES)}); "
                f"need more than train.seq_len + 1 ({seq_len + 1})"
            )
        self.data = torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8)

    def sequence(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(len(self.data) - self.seq_len - 1, (1,), generator=g))
        return self.data[start:start + self.seq_len + 1].long()

    batch = batching.batch


class TokenFiles:
    """Pre-tokenized data (``chipset data prepare`` folders, nanoGPT ``.bin`` files, Megatron indexed
    datasets) through memmap.

    The token stream (documents separated by EOS) is cut into ``n = (tokens - 1) // seq_len``
    windows of ``seq_len + 1`` tokens; each epoch visits every window once, in an order drawn
    from ``(seed, epoch)``. Sequence ``i`` of the run is window ``perm_e[i mod n]`` of epoch
    ``e = i // n``, so like the other sources it depends only on ``(seed, i)``: dp ranks take
    disjoint blocks of each global batch, and a resumed run (at any dp size) reads exactly
    the tokens the uninterrupted run would have.

    ``holdout``: the last fraction of the windows (the end of the stream) is kept out of
    training; ``part = "eval"`` reads only those, in stream order.
    """

    def __init__(self, path: str, seq_len: int, global_batch: int, seed: int = 0, vocab_size: int | None = None,
                 holdout: float = 0.0, part: str = "train", eos_id: int = -1):
        from chipset.data import open_tokens

        self.store = open_tokens(path, eos_id)
        if self.store.meta.get("problem"):  # a Megatron dataset without document ends (data/megatron.py)
            raise ConfigError(self.store.meta["problem"])
        self.source = self.store.source
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.vocab_size = vocab_size
        total = (self.store.total - 1) // seq_len
        held = max(1, int(total * holdout)) if holdout > 0 else 0
        self.part = part
        self.first, self.windows = (total - held, held) if part == "eval" else (0, total - held)
        if self.windows < 1:
            what = "held-out" if part == "eval" else "training"
            raise ConfigError(f"data.path = {path!r} holds {self.store.total} tokens: no {what} sequence of "
                              f"train.seq_len + 1 ({seq_len + 1}) tokens is left (data.eval_fraction = {holdout}); "
                              "use more data or a shorter seq_len")
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int):
        if epoch != self._epoch:
            import numpy as np

            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._epoch = epoch
        return self._perm

    def sequence(self, index: int) -> torch.Tensor:
        epoch, j = divmod(index, self.windows)
        window = self.first + j if self.part == "eval" else int(self._order(epoch)[j])
        start = window * self.seq_len
        seq = torch.from_numpy(self.store.read(start, self.seq_len + 1))
        if self.vocab_size is not None and int(seq.max()) >= self.vocab_size:
            raise ConfigError(f"data.path = {self.source!r} holds token id {int(seq.max())} but model.vocab_size "
                              f"is {self.vocab_size}; set model.vocab_size to the tokenizer's vocabulary size")
        return seq

    batch = batching.batch


def _token_path(cfg) -> str:
    """data.path for tokens; for hf, the cached token folder of the dataset (tokenized on first use)."""
    da = cfg.data
    if da.source == "hf":
        from chipset.data.hf import ensure_prepared

        return str(ensure_prepared(da.path, da.tokenizer, da.field))
    return da.path


def blended_tokens(entries: list[tuple[float, str]], seq_len: int, global_batch: int, seed: int = 0,
                   vocab_size: int | None = None, holdout: float = 0.0, part: str = "train", eos_id: int = -1):
    """``(weight, path)`` sources mixed by weight (data/blend.py): source ``k`` is the :class:`TokenFiles`
    of its path with seed ``seed + k * SEED_STRIDE`` (the first source reads as it would alone)."""
    from chipset.data.blend import SEED_STRIDE, BlendedTokens

    parts = []
    for k, (_, path) in enumerate(entries):
        try:
            parts.append(TokenFiles(path, seq_len, global_batch, seed=seed + k * SEED_STRIDE, vocab_size=vocab_size,
                                    holdout=holdout, part=part, eos_id=eos_id))
        except ConfigError as exc:
            raise ConfigError(f"data.blend entry {k + 1}: {exc}") from None
    return BlendedTokens(entries, parts)


def _blend(cfg, **kw):
    """``data.blend``'s sources mixed by weight."""
    from chipset.data.blend import parse_blend

    tr, da = cfg.train, cfg.data
    entries, bad = parse_blend(da.blend, da.path)
    if bad:
        raise ConfigError("\n".join(bad))
    return blended_tokens(entries, tr.seq_len, tr.global_batch, seed=da.seed, vocab_size=cfg.model.vocab_size,
                          eos_id=da.eos_id, **kw)


def make_dataset(cfg) -> SyntheticTokens | TextBytes | TokenFiles:
    """The dataset a :class:`chipset.train.config.RunConfig` asks for."""
    tr, da = cfg.train, cfg.data
    if da.source == "hf" and da.streaming:
        from chipset.data.streaming import StreamingTokens

        return StreamingTokens(da.path, da.dataset, da.tokenizer, da.field, tr.seq_len, tr.global_batch,
                               seed=da.seed, vocab_size=cfg.model.vocab_size)
    if da.source == "tokens" and da.blend:
        data = _blend(cfg, holdout=da.eval_fraction)
        if os.environ.get("RANK", "0") == "0":  # once per job: every rank builds the same blend
            log.info(data.report(tr.steps))
        return data
    if da.source in ("tokens", "hf"):
        return TokenFiles(_token_path(cfg), tr.seq_len, tr.global_batch, seed=da.seed, vocab_size=cfg.model.vocab_size,
                          holdout=da.eval_fraction, eos_id=da.eos_id)
    if da.source == "text":
        return TextBytes(da.path, tr.seq_len, tr.global_batch, seed=da.seed, max_bytes=da.max_bytes)
    return SyntheticTokens(cfg.model.vocab_size, tr.seq_len, tr.global_batch, seed=da.seed)


def make_eval_dataset(cfg) -> SyntheticTokens | TokenFiles:
    """Held-out data for ``train.eval_every``: data.eval_path, the data.eval_fraction of data.path (of
    each data.blend source, mixed by the same weights), or (synthetic) sequences of the same walk that
    no training step reads."""
    tr, da = cfg.train, cfg.data
    if da.source == "hf" and da.streaming:
        raise ConfigError("train.eval_every with data.streaming: a stream has no held-out part; "
                          "evaluate on prepared tokens (data.source = 'tokens') instead")
    if da.source in ("tokens", "hf"):
        if da.eval_path:
            return TokenFiles(da.eval_path, tr.seq_len, tr.global_batch, seed=da.seed, vocab_size=cfg.model.vocab_size,
                              holdout=1.0, part="eval", eos_id=da.eos_id)
        if da.source == "tokens" and da.blend:
            return _blend(cfg, holdout=da.eval_fraction, part="eval")
        return TokenFiles(_token_path(cfg), tr.seq_len, tr.global_batch, seed=da.seed,
                          vocab_size=cfg.model.vocab_size, holdout=da.eval_fraction, part="eval", eos_id=da.eos_id)
    return SyntheticTokens(cfg.model.vocab_size, tr.seq_len, tr.global_batch, seed=da.seed, offset=HELD_OUT_OFFSET)
