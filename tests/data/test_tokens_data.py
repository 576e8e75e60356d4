"""``chipset data prepare`` with a real BPE tokenizer, and training on its output (data.source = 'tokens')."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest

import forked_cli
from chipset.cli.main import main
from chipset.data.datasets import TokenFiles
from chipset.train.config import load_config
from testenv import clean_env

tokenizers = pytest.importorskip("tokenizers")

WORDS = ("the quick brown fox jumps over lazy dog chip train model layer token shard rank "
         "gradient optimizer batch sequence tensor device memory kernel").split()


def _corpus(tmp_path, docs=60):
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for _ in range(docs)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    return texts, jsonl


def _tokenizer(tmp_path, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


@pytest.fixture
def prepared(tmp_path):
    texts, jsonl = _corpus(tmp_path)
    tok, tok_path = _tokenizer(tmp_path, texts)
    out = tmp_path / "tokens"
    rc = main(["data", "prepare", str(jsonl), "--tokenizer", str(tok_path), "--out", str(out),
               "--field", "body", "--workers", "2", "--shard-tokens", "1000"])
    assert rc == 0
    return texts, tok, out


def test_prepare_writes_shards_that_decode_to_the_documents(prepared):
    texts, tok, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    eos = tok.token_to_id("</s>")
    assert meta["eos_id"] == eos and meta["dtype"] == "uint16" and meta["documents"] == len(texts)
    assert len(meta["shards"]) > 1, "--shard-tokens 1000 must split this corpus"
    stream = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in meta["shards"]])
    assert len(stream) == meta["tokens"] == sum(s["tokens"] for s in meta["shards"])
    docs = np.split(stream, np.flatnonzero(stream == eos) + 1)[:-1]
    assert len(docs) == len(texts)
    for text, doc in zip(texts, docs, strict=True):  # same order, same ids as the tokenizer alone gives
        assert doc[-1] == eos
        assert doc[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids
    starts = np.concatenate([np.load(out / s["index"]) + off for s, off in
                             zip(meta["shards"], np.cumsum([0] + [s["tokens"] for s in meta["shards"]])[:-1], strict=True)])
    assert (stream[starts[1:] - 1] == eos).all(), "index offsets are document starts"
    assert not list(out.parent.glob(".tokens.partial-*")), "no temporary folder is left behind"


def test_token_files_cover_each_epoch_once_and_shard_dp_without_overlap(prepared):
    _, _, out = prepared
    data = TokenFiles(str(out), seq_len=16, global_batch=4, seed=3)
    n = data.windows
    starts = [int(data._order(0)[j]) for j in range(n)]
    assert sorted(starts) == list(range(n)), "an epoch visits every window exactly once"
    one = data.batch(5, 0, 1)[0]
    two = [data.batch(5, r, 2)[0] for r in range(2)]
    assert (np.concatenate([t.numpy() for t in two]) == one.numpy()).all()
    assert data.sequence(n).tolist() != data.sequence(0).tolist() or n == 1  # epoch 1 is reshuffled


def test_nanogpt_bin_files_are_read(tmp_path):
    ids = np.arange(1000, dtype="<u2") % 97
    f = tmp_path / "train.bin"
    ids.tofile(f)
    data = TokenFiles(str(f), seq_len=10, global_batch=2, seed=0)
    seq = data.sequence(0).numpy()
    start = int(data._order(0)[0]) * 10
    assert (seq == ids[start:start + 11]).all()


def test_train_on_prepared_tokens(prepared, tmp_path, capsys):
    _, _, out = prepared
    run_dir = tmp_path / "run"
    cfg = tmp_path / "cfg" / "run.toml"
    cfg.parent.mkdir()
    # data.path relative to the config file's folder
    cfg.write_text('[data]\nsource = "tokens"\npath = "../tokens"\n[model]\nvocab_size = 128\n'
                   '[train]\nsteps = 3\nseq_len = 16\nglobal_batch = 4\n')
    assert main(["train", str(cfg), "--run-dir", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert str(out.resolve()) in (run_dir / "config.toml").read_text()


@pytest.mark.parametrize("args, expect", [
    (["--set", "data.source=tokens"], "data.path is empty"),
    (["--set", "data.source=tokens", "--set", "data.path=/nonexistent/x"], "no such file or directory"),
])
def test_bad_token_config_exits_2(tmp_path, capsys, args, expect):
    assert main(["train", *args, "--run-dir", str(tmp_path / "run")]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_vocab_too_small_for_the_tokenizer_exits_2(prepared, tmp_path, capsys):
    _, _, out = prepared
    rc = main(["train", "--set", "data.source=tokens", "--set", f"data.path={out}",
               "--set", "model.vocab_size=64", "--run-dir", str(tmp_path / "run")])
    vocab = json.loads((out / "meta.json").read_text())["vocab_size"]
    assert rc == 2 and 64 < vocab
    assert f"model.vocab_size (64) is smaller than the tokenizer's vocabulary ({vocab}" in capsys.readouterr().err


def test_prepare_refuses_bad_input_and_writes_nothing(tmp_path, capsys):
    texts, jsonl = _corpus(tmp_path, docs=5)
    _, tok_path = _tokenizer(tmp_path, texts * 10)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(jsonl), "--tokenizer", str(tok_path), "--out", str(out),
                 "--workers", "1"]) == 2
    assert "has no string field 'text'" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["data", "prepare", str(jsonl), "--tokenizer", str(tok_path), "--out", str(out),
                 "--field", "body"]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.multirank
def test_resume_at_another_dp_size_sees_the_same_tokens(prepared, tmp_path):
    """Kill-free version of "resume at a different dp size": 2 ranks stop at step 2 with a checkpoint,
    1 rank resumes to step 4; its losses equal the uninterrupted 2-rank run's.

    Tolerance: the two runs differ only in reduction order (dp 2 vs 1 with 2 micro-batches), so
    the steps' parameters differ by rounding; elements whose gradient is pure rounding noise can
    move by up to 2*lr under Adam, but such elements barely move the loss (first order:
    |grad| * 2*lr ~ 1e-7 * 2e-2). A loss over 4*16 tokens then agrees to ~1e-6 relative; 1e-4 leaves
    margin on any CPU while a shifted data position (other tokens) changes it by > 1e-2.
    """
    _, _, out = prepared
    common = ["--set", "data.source=tokens", "--set", f"data.path={out}", "--set", "model.vocab_size=128",
              "--set", "train.seq_len=16", "--set", "train.global_batch=4", "--set", "train.steps=4"]
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"

    def train(run_dir, *extra):
        r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *common, "--run-dir",
                            str(run_dir), *extra], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    full = train(tmp_path / "full", "--nproc", "2")
    part = tmp_path / "part"
    train(part, "--nproc", "2", "--set", "train.steps=2", "--set", "train.checkpoint_every=2")
    resumed = train(part, "--nproc", "1", "--set", "parallel.micro_batches=2", "--resume", "auto")
    assert len(resumed) == 4
    np.testing.assert_allclose(resumed[2:], full[2:], rtol=1e-4)
    assert abs(resumed[3] - full[2]) > 1e-3, "different steps see different tokens"


def test_eval_reports_loss_and_perplexity_on_held_out_windows(prepared, tmp_path, capsys):
    _, _, out = prepared
    run_dir = tmp_path / "run"
    assert main(["train", "--set", "data.source=tokens", "--set", f"data.path={out}", "--set", "model.vocab_size=128",
                 "--set", "data.eval_fraction=0.2", "--set", "train.eval_every=2", "--set", "train.eval_steps=2",
                 "--set", "train.steps=5", "--set", "train.seq_len=16", "--set", "train.global_batch=4",
                 "--run-dir", str(run_dir)]) == 0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in recs if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 5], "every eval_every steps and after the last step"
    for r in evals.values():
        assert r["eval_ppl"] == pytest.approx(np.exp(r["eval_loss"]))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] == evals[5]["eval_loss"] and summary["eval_step"] == 5
    table = capsys.readouterr().out
    assert f"eval loss (step 5)     {summary['eval_loss']:.4f}" in table, "the end table shows the last eval loss"
    assert summary["wall_time_s"] > 0 and "total time" in table
    train_part = TokenFiles(str(out), 16, 4, holdout=0.2)
    eval_part = TokenFiles(str(out), 16, 4, holdout=0.2, part="eval")
    assert train_part.windows + eval_part.windows == (train_part.store.total - 1) // 16
    assert max(int(train_part._order(0)[j]) for j in range(train_part.windows)) < eval_part.first


@pytest.mark.parametrize("args, expect", [
    (["--set", "train.eval_every=2", "--set", "parallel.pp=2", "--nproc", "2"], "parallel.pp > 1 is not supported"),
    (["--set", "train.eval_every=2", "--set", "data.source=text"], "data.source = 'text' has none"),
    (["--set", "data.eval_fraction=0.9"], "data.eval_fraction = 0.9: expected a fraction in [0, 0.5]"),
])
def test_bad_eval_config_exits_2(tmp_path, capsys, args, expect):
    assert main(["train", *args, "--run-dir", str(tmp_path / "run")]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_two_rank_zero3_eval_matches_one_process(prepared, tmp_path):
    """Eval through ZeRO-3's gather hooks on 2 ranks equals one process (tolerance as in the
    resume test above: the runs differ only in reduction order)."""
    _, _, out = prepared
    common = ["--set", "data.source=tokens", "--set", f"data.path={out}", "--set", "model.vocab_size=128",
              "--set", "data.eval_fraction=0.2", "--set", "train.eval_every=2", "--set", "train.steps=2",
              "--set", "train.seq_len=16", "--set", "train.global_batch=4"]
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    evals = []
    for extra in (["--nproc", "2", "--set", "parallel.zero=3"], []):
        run_dir = tmp_path / f"run{len(evals)}"
        r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *common, *extra, "--run-dir",
                            str(run_dir)], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "eval at step 2: loss" in r.stdout
        evals.append(json.loads((run_dir / "summary.json").read_text())["eval_loss"])
    assert evals[0] == pytest.approx(evals[1], rel=1e-4)


def test_parquet_and_text_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts, _ = _corpus(tmp_path, docs=30)
    tok, tok_path = _tokenizer(tmp_path, texts)
    pq.write_table(pa.table({"content": texts[:20], "n": list(range(20))}), tmp_path / "part.parquet")
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(texts[20:]):
        (folder / f"{i:02d}.txt").write_text(t)
    out = tmp_path / "tok"
    assert main(["data", "prepare", str(tmp_path / "part.parquet"), str(folder), "--tokenizer", str(tok_path),
                 "--out", str(out), "--field", "content", "--workers", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 30
    expected = sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    assert meta["tokens"] == expected


def test_an_eval_split_smaller_than_the_requested_batches_is_flagged(prepared, tmp_path, caplog):
    """eval_steps x global_batch beyond the held-out windows: windows repeat; the run says so."""
    _, _, out = prepared
    held = TokenFiles(str(out), 16, 4, holdout=0.2, part="eval").windows
    sets = ["data.source=tokens", f"data.path={out}", "model.vocab_size=128", "data.eval_fraction=0.2",
            "train.eval_every=1", "train.steps=1", "train.seq_len=16", "train.global_batch=4"]
    enough = held // 4
    with caplog.at_level("WARNING", logger="chipset.train.evaluate"):
        argv = ["train", *[x for s in [*sets, f"train.eval_steps={enough}"] for x in ("--set", s)]]
        assert main([*argv, "--run-dir", str(tmp_path / "fits")]) == 0
        assert "windows repeat" not in caplog.text
        argv = ["train", *[x for s in [*sets, f"train.eval_steps={enough + 1}"] for x in ("--set", s)]]
        assert main([*argv, "--run-dir", str(tmp_path / "short")]) == 0
    assert f"= {(enough + 1) * 4} sequences, but the held-out data has {held} window(s)" in caplog.text
    assert f"set train.eval_steps = {enough}" in caplog.text


def test_synthetic_held_out_sequences_are_not_training_sequences():
    """torch's generator keeps a seed's low 32 bits: an offset of 2**40 made the 'held-out'
    synthetic sequences the training ones. Held-out sequence i is not any early training one."""
    from chipset.data.datasets import make_dataset, make_eval_dataset

    # 4096 tokens and 65-token windows: two walks (10% random jumps) agree by chance with p < 1e-6
    cfg = load_config(None, ["train.eval_every=1", "train.seq_len=64", "train.global_batch=4", "model.vocab_size=4096"])
    trained = {tuple(t.flatten().tolist()) for step in range(64) for t in make_dataset(cfg).batch(step, 0, 1, 0, 1)[0]}
    held = [tuple(t.flatten().tolist()) for t in make_eval_dataset(cfg).batch(0, 0, 1, 0, 1)[0]]
    assert not trained.intersection(held)
