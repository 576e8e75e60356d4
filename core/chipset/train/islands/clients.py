"""Federated clients: private data per island, the clients of each round, non-IID splits.

``islands.client_data`` names one data path per island: the worker of island ``i`` reads its
config with ``data.path`` set to entry ``i`` (:func:`client_config`), so no client process ever
opens another client's data. Island ``i`` still reads the samples of its share of each step's
batch (sample indices ``step * G + i * G / count ...``), from its own data.

``islands.clients_per_round = k``: the islands of round ``r`` are a subset of size ``k``
drawn from ``(train.seed, r)`` (:func:`round_clients`), the same on every island without a
message. The others send zeros (and, with secure aggregation, their masks) and receive the
round's global parameters.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

from chipset.train.islands.config import client_paths

__all__ = ["client_config", "round_clients", "split_by_source", "DataFingerprint"]


def client_config(cfg, island: int | None):
    """``cfg`` as island ``island`` reads it: ``data.path`` = its ``islands.client_data`` entry
    (``cfg`` itself when no entry is named or outside an islands job)."""
    paths = client_paths(cfg.islands)
    if island is None or not paths or island >= len(paths):
        return cfg  # validation says what is wrong with the list
    cfg.data.path = paths[island]
    return cfg


def round_clients(seed: int, round_index: int, count: int, per_round: int) -> tuple[int, ...]:
    """The islands (sorted) that take part in outer step ``round_index`` (0-based): all of them
    when ``per_round >= count``, else ``per_round`` of them drawn from ``(seed, round_index)``."""
    if per_round >= count:
        return tuple(range(count))
    rng = random.Random(f"chipset-round/{seed}/{round_index}")  # str seeds hash with SHA-512: stable everywhere
    return tuple(sorted(rng.sample(range(count), per_round)))


def split_by_source(sources: list[list[Path]], out: Path) -> list[Path]:
    """A non-IID split for tests and demos: client ``i`` gets the text files ``sources[i]`` (e.g. the
    modules of one package each), concatenated into ``out/client-<i>.txt``. Returns the files, in
    client order, for ``islands.client_data``."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, group in enumerate(sources):
        if not group:
            raise ValueError(f"client {i} got no source file; give every client at least one")
        path = out / f"client-{i}.txt"
        with open(path, "wb") as f:
            for src in group:
                with open(src, "rb") as g:
                    shutil.copyfileobj(g, f)
                f.write(b"\n")
        files.append(path)
    return files


class DataFingerprint:
    """``data`` that also hashes every batch it hands out (SHA-256 over the input and target
    bytes, in order): an island's summary records what it trained on, and a test can recompute
    it from the client's own data alone."""

    def __init__(self, data, source: str):
        self._data = data
        self.source = source
        self.batches = 0
        self._hash = hashlib.sha256()

    def __getattr__(self, name):
        return getattr(self._data, name)

    def batch(self, *args, **kwargs):
        inputs, targets = self._data.batch(*args, **kwargs)
        for t in (inputs, targets):
            self._hash.update(t.detach().cpu().contiguous().numpy().tobytes())
        self.batches += 1
        return inputs, targets

    def summary(self) -> dict:
        return {"path": self.source, "batches": self.batches, "sha256": self._hash.hexdigest()}
