"""``data.blend``: several token sources mixed with weights, deterministically.

Syntax: one string of ``WEIGHT:PATH`` entries separated by commas, the weights summing to 1::

    data.blend = "0.7:wiki, 0.2:/data/code_text_document, 0.1:books.bin"

Each PATH is anything ``data.source = "tokens"`` reads (a prepared folder, a flat ``.bin`` file,
a Megatron ``PREFIX``); a relative PATH is resolved against ``data.path``, which is then the
folder of the sources (and is itself resolved against the config file's folder).

Sampling: sequence ``i`` of the run comes from source ``k`` and is that source's own sequence
``j`` (its windows, shuffled per epoch from ``(data.seed + k * SEED_STRIDE, epoch)`` exactly
like a single source). ``(k, j)`` depends only on the weights and ``i``: the sources are
interleaved in blocks of :data:`BLOCK` sequences, each block laid out the same way by the
largest-deficit rule (the next sequence goes to the source furthest below ``weight * n``, the
first such source on ties), so every prefix of the run holds each source's share to within one
sequence, and source ``k``'s ``j`` runs 0, 1, 2, ... without gaps. A step's batch is therefore
the same on every layout and after a resume, like every other source (datasets.py). A source
smaller than its share is repeated (new epochs, reshuffled); a larger one is not read to the
end.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from chipset.data import batching
from chipset.errors import ConfigError

BLOCK = 10_000
SEED_STRIDE = 1_000_003
SUM_TOLERANCE = 1e-6
EXAMPLE = "0.7:/data/wiki, 0.3:/data/code"


def parse_blend(text: str, base: str = "") -> tuple[list[tuple[float, str]], list[str]]:
    """``data.blend`` -> ([(weight, absolute path), ...], problems)."""
    entries: list[tuple[float, str]] = []
    problems: list[str] = []
    shape = f"expected WEIGHT:PATH entries separated by commas, e.g. data.blend = {EXAMPLE!r}"
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        return [], [f"data.blend = {text!r} names no source; {shape}"]
    if base and not Path(base).is_dir():
        problems.append(f"data.path = {base!r} is not a folder: with data.blend set, data.path is the folder that "
                        "relative blend paths are resolved against; set it to that folder or leave it empty")
        base = ""
    for n, item in enumerate(items, 1):
        w, sep, path = item.partition(":")
        path = path.strip()
        try:
            weight = float(w)
        except ValueError:
            weight = None
        if not item or not sep or not path or weight is None:
            problems.append(f"data.blend entry {n} ({item!r}): not WEIGHT:PATH; {shape}")
            continue
        if not math.isfinite(weight) or weight <= 0:
            problems.append(f"data.blend entry {n} ({item!r}): weight {w.strip()}, expected a positive number "
                            "(to leave a source out, remove its entry)")
            continue
        p = Path(path).expanduser()
        if not p.is_absolute():
            if not base:
                problems.append(f"data.blend entry {n} ({item!r}): {path!r} is a relative path and data.path names no "
                                "folder to resolve it against; give an absolute path, or set data.path to the folder "
                                "of the sources (e.g. --set data.path=. for the current folder; in a config file, "
                                "relative to the file's folder)")
                continue
            p = Path(base) / p
        entries.append((weight, str(p)))
    if not problems:
        seen: dict[str, int] = {}
        for n, (_, path) in enumerate(entries, 1):
            if path in seen:
                problems.append(f"data.blend entries {seen[path]} and {n} both name {path!r}; give each source once "
                                "with the sum of its weights")
            seen.setdefault(path, n)
        total = sum(w for w, _ in entries)
        if abs(total - 1) > SUM_TOLERANCE:
            scaled = ", ".join(f"{w / total:.4g}:{p}" for w, p in entries)
            problems.append(f"data.blend weights sum to {total:g} ({' + '.join(f'{w:g}' for w, _ in entries)}), "
                            f"expected 1; scale them, e.g. data.blend = {scaled!r}")
        else:
            problems += _too_small(entries)
    return entries, problems


def _too_small(entries: list[tuple[float, str]]) -> list[str]:
    w = np.array([w for w, _ in entries], dtype=np.float64)
    per_block = interleave(w / w.sum())[2]
    return [f"data.blend entry {k + 1} ({entries[k][1]}): weight {entries[k][0]:g} is too small to draw even one "
            f"sequence in {BLOCK}; give it at least {1 / BLOCK:g} of the total or remove it"
            for k in range(len(entries)) if not per_block[k]]


def interleave(weights: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layout of one block: ``(source of slot, rank of the slot within its source, per-source count)``."""
    counts = np.zeros(len(weights), dtype=np.int64)
    source = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for i in range(block):
        k = int(np.argmax(weights * (i + 1) - counts))
        source[i], rank[i] = k, counts[k]
        counts[k] += 1
    return source, rank, counts


class BlendedTokens:
    """Token sources mixed by weight; the same ``batch`` contract as each of them."""

    def __init__(self, entries: list[tuple[float, str]], parts: list):
        """``entries``: ``(weight, path)`` of each source; ``parts``: its dataset (a ``TokenFiles``;
        :func:`chipset.data.datasets.blended_tokens` builds both from ``data.blend``)."""
        self.parts = parts
        self.paths = [p for _, p in entries]
        self.seq_len, self.global_batch = parts[0].seq_len, parts[0].global_batch
        self.source = ", ".join(self.paths)
        w = np.array([w for w, _ in entries], dtype=np.float64)
        self.weights = w / w.sum()
        self.slot_source, self.slot_rank, self.per_block = interleave(self.weights)
        if not self.per_block.all():
            raise ConfigError("\n".join(_too_small(entries)))

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, that source's sequence index)`` of the run's sequence ``index``."""
        block, slot = divmod(index, BLOCK)
        k = int(self.slot_source[slot])
        return k, block * int(self.per_block[k]) + int(self.slot_rank[slot])

    def sequence(self, index: int) -> torch.Tensor:
        k, j = self.locate(index)
        return self.parts[k].sequence(j)

    def counts(self, n: int) -> np.ndarray:
        """How many of the run's first ``n`` sequences each source supplies."""
        full, rest = divmod(n, BLOCK)
        return full * self.per_block + np.bincount(self.slot_source[:rest], minlength=len(self.parts))

    def report(self, steps: int) -> str:
        """The log line: each source's weight, the proportion the run's sequences realise, its epochs."""
        n = steps * self.global_batch
        counts = self.counts(n)
        parts = [f"{path}: weight {w:.4g}, realised {c / max(n, 1):.4f} ({c} sequences, "
                 f"{c / part.windows:.3g} epochs of its {part.windows} windows)"
                 for path, w, c, part in zip(self.paths, self.weights, counts, self.parts, strict=True)]
        return (f"data.blend: {len(self.parts)} sources over the run's {n} sequences ({steps} steps x "
                f"{self.global_batch}): " + "; ".join(parts))

    batch = batching.batch
