"""data.source = 'hf': a folder saved by Hugging Face ``datasets``, tokenized once into the token pipeline."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from test_tokens_data import _corpus, _tokenizer

from chipset.cli.main import main

pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CHIPSET_DATA_CACHE", str(tmp_path / "cache"))
    texts, jsonl = _corpus(tmp_path, docs=40)
    _, tok_path = _tokenizer(tmp_path, texts)
    ds_dir = tmp_path / "ds"
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "body": texts}).save_to_disk(str(ds_dir))
    return jsonl, tok_path, ds_dir


def _stream(folder):
    meta = json.loads((folder / "meta.json").read_text())
    return meta, np.concatenate([np.fromfile(folder / s["file"], dtype="<u2") for s in meta["shards"]])


def test_prepare_reads_a_saved_dataset_like_the_same_jsonl(hf_dir, tmp_path):
    jsonl, tok, ds_dir = hf_dir
    for name, src in (("from-jsonl", jsonl), ("from-hf", ds_dir)):
        assert main(["data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(tmp_path / name),
                     "--field", "body", "--workers", "1"]) == 0
    (m1, s1), (m2, s2) = _stream(tmp_path / "from-jsonl"), _stream(tmp_path / "from-hf")
    assert m1["documents"] == m2["documents"] == 40 and (s1 == s2).all()


def test_train_on_hf_source_equals_training_on_its_tokens(hf_dir, tmp_path):
    """Same tokens, same seed, one process: the losses are bit-equal, so hf is the tokens pipeline
    (data order, resume position and dp sharding included), not a second loader."""
    jsonl, tok, ds_dir = hf_dir
    assert main(["data", "prepare", str(jsonl), "--tokenizer", str(tok), "--out", str(tmp_path / "tok"),
                 "--field", "body", "--workers", "1"]) == 0
    common = ["--set", "model.vocab_size=128", "--set", "train.seq_len=16", "--set", "train.global_batch=4",
              "--set", "train.steps=3", "--set", "train.checkpoint_every=0"]

    def losses(run_dir, *data):
        assert main(["train", *common, *data, "--run-dir", str(run_dir)]) == 0
        return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    ref = losses(tmp_path / "r1", "--set", "data.source=tokens", "--set", f"data.path={tmp_path / 'tok'}")
    hf = ["--set", "data.source=hf", "--set", f"data.path={ds_dir}", "--set", f"data.tokenizer={tok}",
          "--set", "data.field=body"]
    assert losses(tmp_path / "r2", *hf) == ref
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and (cached[0] / "meta.json").is_file()
    mtime = (cached[0] / "meta.json").stat().st_mtime_ns
    assert losses(tmp_path / "r3", *hf) == ref
    assert (cached[0] / "meta.json").stat().st_mtime_ns == mtime, "the second run reuses the cache"


@pytest.mark.parametrize("extra, expect", [
    ([], "needs data.tokenizer"),
    (["--set", "data.tokenizer=TOK", "--set", "data.field=nope"], "data.field = 'nope': the dataset"),
    (["--set", "data.tokenizer=TOK", "--set", "data.field=body", "--set", "model.vocab_size=64"], "model.vocab_size (64) is smaller"),
])
def test_bad_hf_config_exits_2(hf_dir, tmp_path, capsys, extra, expect):
    _, tok, ds_dir = hf_dir
    extra = [e.replace("TOK", str(tok)) for e in extra]
    rc = main(["train", "--set", "data.source=hf", "--set", f"data.path={ds_dir}", *extra,
               "--run-dir", str(tmp_path / "run")])
    assert rc == 2 and expect in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "cache").glob("*/meta.json")) if (tmp_path / "cache").exists() else True


def test_missing_datasets_package_names_the_extra(hf_dir, tmp_path, capsys, monkeypatch):
    _, tok, ds_dir = hf_dir
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an install without the package raises
    rc = main(["train", "--set", "data.source=hf", "--set", f"data.path={ds_dir}", "--set", f"data.tokenizer={tok}",
               "--run-dir", str(tmp_path / "run")])
    assert rc == 2 and "pip install 'chipset[hf-data]'" in capsys.readouterr().err
