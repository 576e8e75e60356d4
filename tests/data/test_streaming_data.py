"""data.source = 'hf' with data.streaming: records streamed by ``datasets`` (local JSONL here, no
network), tokenized on the fly, deterministic per step on every layout and after a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_tokens_data import _corpus, _tokenizer

from chipset.cli.main import main
from chipset.data.streaming import StreamingTokens

pytest.importorskip("tokenizers")
pytest.importorskip("datasets")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    texts, jsonl = _corpus(tmp_path, docs=40)
    tok, tok_path = _tokenizer(tmp_path, texts)
    return texts, tok, jsonl, tok_path


def _data(jsonl, tok_path, global_batch=4, seed=0):
    return StreamingTokens(str(jsonl), "", str(tok_path), "body", seq_len=16, global_batch=global_batch, seed=seed)


def test_stream_is_the_documents_each_followed_by_eos_epoch_after_epoch(corpus):
    texts, tok, jsonl, tok_path = corpus
    data = _data(jsonl, tok_path)
    eos = tok.token_to_id("</s>")
    encoded = {tuple(tok.encode(t, add_special_tokens=False).ids) for t in texts}
    epoch_tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    stream = data.read(0, 2 * epoch_tokens + 5)
    first, second = stream[:epoch_tokens], stream[epoch_tokens:2 * epoch_tokens]
    for epoch in (first, second):
        assert epoch[-1] == eos
        docs = [tuple(d) for d in np.split(epoch, np.flatnonzero(epoch == eos) + 1)[:-1]]
        assert {d[:-1] for d in docs} == encoded and len(docs) == len(texts), "every document once per epoch"
    assert not (first == second).all(), "each epoch is shuffled again (seed + epoch)"
    assert (data.sequence(3).numpy() == stream[48:65]).all(), "sequence i is tokens i*seq_len .. i*seq_len+seq_len"


def test_stream_batches_are_the_same_on_every_layout_and_after_a_resume(corpus):
    _, _, jsonl, tok_path = corpus
    one = _data(jsonl, tok_path)
    ref = [one.batch(s, 0, 1)[0].numpy() for s in range(12)]  # past the end of the first epoch
    halves = [_data(jsonl, tok_path) for _ in range(2)]
    for s in range(12):
        got = np.concatenate([halves[r].batch(s, r, 2, m, 2)[0].numpy() for r in range(2) for m in range(2)])
        assert (got == ref[s]).all()
    resumed = _data(jsonl, tok_path)
    assert all((resumed.batch(s, 0, 1)[0].numpy() == ref[s]).all() for s in range(7, 12))
    assert (resumed.batch(2, 0, 1)[0].numpy() == ref[2]).all(), "an earlier step rewinds the stream"
    other = _data(jsonl, tok_path, seed=1)
    assert not (other.batch(0, 0, 1)[0].numpy() == ref[0]).all(), "data.seed changes the order"


def _overrides(jsonl, tok_path, *extra):
    return ["data.source=hf", "data.streaming=true", f"data.path={jsonl}", f"data.tokenizer={tok_path}",
            "data.field=body", "model.vocab_size=128", "train.seq_len=16", "train.global_batch=4", *extra]


def _train(tmp_path, jsonl, tok_path, *extra, run="run"):
    sets = [x for o in _overrides(jsonl, tok_path, *extra) for x in ("--set", o)]
    return main(["train", *sets, "--run-dir", str(tmp_path / run)])


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_streaming_and_resume_sees_the_uninterrupted_tokens(corpus, tmp_path, caplog):
    """The training loop on a stream (a rank as the launcher runs it, in this process): a run stopped at
    step 2 and resumed to step 4 has the losses of the uninterrupted run, bit for bit."""
    from chipset.train.config import load_config, to_toml
    from chipset.train.worker import run_rank

    _, _, jsonl, tok_path = corpus

    def run(name, *extra, resume="none"):
        cfg = tmp_path / f"{name}-{len(extra)}.toml"
        cfg.write_text(to_toml(load_config(None, _overrides(jsonl, tok_path, *extra))))
        assert run_rank(str(cfg), str(tmp_path / name), resume=resume) == 0
        return _losses(tmp_path / name)

    full = run("full", "train.steps=4")
    run("part", "train.steps=2", "train.checkpoint_every=2")
    with caplog.at_level("INFO", logger="chipset.data.streaming"):
        resumed = run("part", "train.steps=4", resume="auto")
    assert len(full) == 4 and resumed == full
    assert "data.streaming: read 128 tokens" in caplog.text, "the resume's skip (2 steps x 4 x 16) is logged"
    assert not list(tmp_path.glob("**/meta.json")), "streaming prepares no token folder"


def test_chipset_train_streams(corpus, tmp_path, capsys):
    _, _, jsonl, tok_path = corpus
    assert _train(tmp_path, jsonl, tok_path, "train.steps=2") == 0, capsys.readouterr().err


@pytest.mark.parametrize("extra, expect", [
    (["data.field=nope"], "data.field = 'nope': the first record of"),
    (["data.path=/nonexistent/x.jsonl"], "data.path = '/nonexistent/x.jsonl': no such file, folder or glob"),
    (["data.eval_fraction=0.1"], "data.eval_fraction = 0.1 with data.streaming: a stream has no known end"),
    (["data.dataset=owner/name"], "data.path = 'JSONL' and data.dataset = 'owner/name' are both set"),
    (["data.tokenizer="], "data.streaming needs data.tokenizer"),
    (["model.vocab_size=64"], "model.vocab_size (64) is smaller than data.tokenizer's vocabulary"),
])
def test_bad_streaming_config_exits_2(corpus, tmp_path, capsys, extra, expect):
    _, _, jsonl, tok_path = corpus
    assert _train(tmp_path, jsonl, tok_path, *extra) == 2
    assert expect.replace("JSONL", str(jsonl)) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_streaming_keys_are_refused_out_of_place(tmp_path, capsys):
    assert main(["train", "--set", "data.streaming=true", "--run-dir", str(tmp_path / "r")]) == 2
    assert "data.streaming = true but data.source = 'synthetic'" in capsys.readouterr().err
    assert main(["train", "--set", "data.dataset=owner/name", "--run-dir", str(tmp_path / "r")]) == 2
    assert "data.dataset = 'owner/name' names a Hub dataset to stream" in capsys.readouterr().err


def test_hub_dataset_name_and_config_reach_load_dataset(corpus, monkeypatch):
    """No network here: the Hub call is replaced by the local stream, to check what it is asked for."""
    import datasets

    _, _, jsonl, tok_path = corpus
    real, calls = datasets.load_dataset, []

    def fake(name, config=None, **kw):
        calls.append((name, config, kw))
        return real("json", data_files=[str(jsonl)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    data = StreamingTokens("", "owner/corpus:en", str(tok_path), "body", seq_len=16, global_batch=4)
    assert data.batch(0, 0, 1)[0].shape == (4, 16)
    assert calls == [("owner/corpus", "en", {"split": "train", "streaming": True})]
