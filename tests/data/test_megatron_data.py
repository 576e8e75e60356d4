"""Megatron-LM / MindSpeed indexed datasets (PREFIX.bin + PREFIX.idx) read as they are by data.source = 'tokens'.

The files are written here from the published format (megatron/core/datasets/indexed_dataset.py,
``_IndexWriter``), not with Megatron's code; ``test_megatron_core_builder_output_is_read`` runs the
same check on what megatron-core's own ``IndexedDatasetBuilder`` writes when that package is installed.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from chipset.cli.main import main
from chipset.data import open_tokens
from chipset.data.datasets import TokenFiles
from chipset.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}
EOS = 1


def write_megatron(prefix, documents, dtype=np.uint16, code=None, magic=MAGIC):
    """``documents``: a list of documents, each a list of sequences (lists of token ids), as
    Megatron's builder stores them: sequences back to back in PREFIX.bin, PREFIX.idx as in the spec."""
    sizes, doc_idx = [], [0]
    with open(f"{prefix}.bin", "wb") as fh:
        for doc in documents:
            for seq in doc:
                fh.write(np.asarray(seq, dtype=dtype).tobytes())
                sizes.append(len(seq))
            doc_idx.append(len(sizes))
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * item if sizes else np.zeros(0, np.int64)
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(magic)
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", code if code is not None else CODES[dtype]))
        fh.write(struct.pack("<Q", len(sizes)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(np.asarray(sizes, dtype=np.int32).tobytes())
        fh.write(pointers.tobytes())
        fh.write(np.asarray(doc_idx, dtype=np.int64).tobytes())
    return prefix


def _docs(n=120, seed=0, vocab=100):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, rng.integers(5, 60)).tolist() for _ in range(n)]


def _stream(docs):
    """The token stream a prepared folder holds for these documents: each followed by EOS."""
    return np.concatenate([np.asarray(d + [EOS]) for d in docs])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_dataset_reads_like_the_same_flat_tokens(tmp_path, dtype):
    """Preprocessed with --append-eod (each document ends with EOS, split in two sequences as sentence
    splitting does): every path form gives the stream a prepared folder of the same documents holds,
    and TokenFiles draws the same sequences from it as from that stream as a flat .bin file."""
    docs = _docs()
    prefix = write_megatron(tmp_path / "corpus_text_document",
                            [[d[:len(d) // 2], d[len(d) // 2:] + [EOS]] for d in docs], dtype=dtype)
    flat = tmp_path / "flat.bin"
    _stream(docs).astype("<u2").tofile(flat)
    for path in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        store = open_tokens(path)
        assert store.meta["eos_id"] == EOS and store.meta["documents"] == len(docs) and store.meta["eod"] == "in data"
        assert (store.read(0, store.total) == _stream(docs)).all()
        mg, ref = (TokenFiles(str(p), seq_len=16, global_batch=4, seed=5) for p in (path, flat))
        assert mg.windows == ref.windows
        for i in range(0, 3 * mg.windows, 7):  # across epochs
            assert (mg.sequence(i) == ref.sequence(i)).all()


def test_documents_without_eod_get_data_eos_id_inserted(tmp_path):
    """Preprocessed without --append-eod: nothing separates documents. Refused (exit 2) with the fix,
    and with data.eos_id the stream is the prepared folder's: EOS after every document."""
    docs = _docs()
    prefix = write_megatron(tmp_path / "noeod", [[d] for d in docs])
    with pytest.raises(ConfigError, match="preprocessed without --append-eod.*set data.eos_id"):
        TokenFiles(str(prefix), seq_len=16, global_batch=4)
    store = open_tokens(prefix, eos_id=EOS)
    assert store.meta["eod"] == "inserted" and store.total == len(_stream(docs))
    full = _stream(docs)
    assert (store.read(0, store.total) == full).all()
    for start in range(0, store.total - 17, 13):  # windows that span documents and their inserted EOS
        assert (store.read(start, 17) == full[start:start + 17]).all()


def _train(tmp_path, capsys, *extra, run="run"):
    rc = main(["train", "--set", "data.source=tokens", "--set", "model.vocab_size=128", "--set", "train.steps=2",
               "--set", "train.seq_len=16", "--set", "train.global_batch=4", *extra,
               "--run-dir", str(tmp_path / run)])
    return rc, capsys.readouterr()


def test_train_on_a_megatron_prefix_equals_training_on_its_tokens(tmp_path, capsys):
    docs = _docs()
    write_megatron(tmp_path / "mg", [[d] for d in docs])  # no EOD: data.eos_id inserts it
    _stream(docs).astype("<u2").tofile(tmp_path / "flat.bin")
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={tmp_path / 'mg'}")
    assert rc == 2 and "preprocessed without --append-eod" in out.err and not (tmp_path / "run").exists()
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={tmp_path / 'mg'}", "--set", f"data.eos_id={EOS}", run="a")
    assert rc == 0, out.err
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={tmp_path / 'flat.bin'}", run="b")
    assert rc == 0, out.err
    losses = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def _corrupt(kind, tmp_path):
    docs = [[d + [EOS]] for d in _docs(10)]
    prefix = tmp_path / "c"
    if kind == "float":
        return write_megatron(prefix, docs, dtype=np.uint16, code=7)
    write_megatron(prefix, docs, magic=b"TNTIDX\x00\x00" if kind == "legacy" else MAGIC)
    idx, binf = tmp_path / "c.idx", tmp_path / "c.bin"
    if kind == "no-idx":
        idx.unlink()
    elif kind == "no-bin":
        binf.unlink()
    elif kind == "magic":
        idx.write_bytes(b"NOTMEGAT!" + idx.read_bytes()[9:])
    elif kind == "truncated-idx":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif kind == "truncated-bin":
        binf.write_bytes(binf.read_bytes()[:-4])
    return prefix


@pytest.mark.parametrize("kind, expect", [
    ("no-idx", "c.idx is missing (found c.bin); a Megatron indexed dataset is PREFIX.bin + PREFIX.idx"),
    ("no-bin", "c.bin is missing (found c.idx)"),
    ("magic", "c.idx starts with b'NOTMEGAT!', expected the Megatron index magic b'MMIDIDX\\x00\\x00'"),
    ("legacy", "Megatron's older non-mmap IndexedDataset"),
    ("truncated-idx", "its header (10 sequences, 11 document indices) needs"),
    ("truncated-bin", "the two files are from different runs or one is truncated"),
    ("float", "declares dtype code 7 (float32)"),
])
def test_bad_megatron_data_exits_2(tmp_path, capsys, kind, expect):
    prefix = _corrupt(kind, tmp_path)
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={prefix}")
    assert rc == 2 and expect in out.err, out.err
    assert not (tmp_path / "run").exists()


def test_a_stray_idx_beside_a_flat_bin_says_how_to_read_the_bin(tmp_path, capsys):
    np.arange(100, dtype="<u2").tofile(tmp_path / "train.bin")
    (tmp_path / "train.idx").write_bytes(b"something else entirely, 34 bytes long")
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={tmp_path / 'train.bin'}")
    assert rc == 2 and "if train.bin is a flat nanoGPT token file, move train.idx away" in out.err


def test_data_eos_id_is_refused_where_it_means_nothing(tmp_path, capsys):
    np.arange(100, dtype="<u2").tofile(tmp_path / "train.bin")
    rc, out = _train(tmp_path, capsys, "--set", f"data.path={tmp_path / 'train.bin'}", "--set", "data.eos_id=3")
    assert rc == 2 and "data.eos_id = 3 applies to Megatron indexed datasets" in out.err


def test_megatron_core_builder_output_is_read(tmp_path):
    """Cross-check with Megatron's own writer (skipped unless megatron-core is importable)."""
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = _docs(40)
    for eod in (True, False):
        prefix = tmp_path / f"mcore-{eod}"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for d in docs:
            builder.add_document(torch.tensor(d + [EOS] * eod), [len(d) + eod])
        builder.finalize(f"{prefix}.idx")
        mine = write_megatron(tmp_path / f"mine-{eod}", [[d + [EOS] * eod] for d in docs])
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"mcore-{eod}{suffix}").read_bytes() == (tmp_path / f"mine-{eod}{suffix}").read_bytes()
        store = open_tokens(prefix, eos_id=-1 if eod else EOS)
        assert (store.read(0, store.total) == _stream(docs)).all()
        assert open_tokens(mine, eos_id=-1 if eod else EOS).total == store.total
