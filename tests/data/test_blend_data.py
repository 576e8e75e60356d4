"""data.blend: token sources mixed by weight, deterministic per step on every layout and after a resume."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from test_megatron_data import EOS, _docs, _stream, write_megatron

import forked_cli
from chipset.cli.main import main
from chipset.data.blend import BLOCK, parse_blend
from chipset.data.datasets import TokenFiles, blended_tokens
from testenv import clean_env


@pytest.fixture
def sources(tmp_path):
    """Three sources of three kinds, with token ids in disjoint ranges so a sequence names its source."""
    a = tmp_path / "a.bin"
    (_stream(_docs(80, seed=1, vocab=40))).astype("<u2").tofile(a)  # ids < 40
    write_megatron(tmp_path / "b_text_document", [[[t + 40 for t in d] + [EOS]] for d in _docs(40, seed=2, vocab=40)])
    c = tmp_path / "c.bin"
    (np.arange(3000) % 40 + 80).astype("<u2").tofile(c)  # ids 80..119, no EOS: never mistaken
    return tmp_path, [a, tmp_path / "b_text_document", c]


def _source_of(seq):
    ids = seq[seq != EOS]
    return int(ids.max()) // 40


def test_blend_draws_each_source_by_weight_and_reads_its_sequences(sources):
    _, paths = sources
    weights = [0.5, 0.3, 0.2]
    blend = blended_tokens(list(zip(weights, map(str, paths), strict=True)), seq_len=16, global_batch=8, seed=4)
    alone = [TokenFiles(str(p), 16, 8, seed=4 + k * 1_000_003) for k, p in enumerate(paths)]
    seen = np.zeros(3, dtype=int)
    for i in range(2 * BLOCK + 123):
        k, j = blend.locate(i)
        assert j == seen[k], "each source's sequences are used in order, without gaps"
        seen[k] += 1
        # every prefix holds each source's share to within one sequence
        assert np.abs(seen - np.array(weights) * (i + 1)).max() <= 1
    assert (blend.counts(2 * BLOCK + 123) == seen).all()
    assert (blend.per_block == [5000, 3000, 2000]).all()
    for i in range(0, 400, 3):  # sequence i is source k's own sequence j
        k, j = blend.locate(i)
        seq = blend.sequence(i)
        assert (seq == alone[k].sequence(j)).all() and _source_of(seq.numpy()) == k
    # the global batch of a step is the same split over any dp x micro-batches
    one = blend.batch(7, 0, 1)[0]
    four = np.concatenate([blend.batch(7, r, 2, m, 2)[0].numpy() for r in range(2) for m in range(2)])
    assert (four == one.numpy()).all()


def test_a_single_source_blend_is_that_source(sources):
    _, paths = sources
    blend = blended_tokens([(1.0, str(paths[1]))], seq_len=16, global_batch=4, seed=9)
    ref = TokenFiles(str(paths[1]), 16, 4, seed=9)
    assert all((blend.sequence(i) == ref.sequence(i)).all() for i in range(50))


def test_parse_blend_resolves_relative_paths_against_data_path(sources):
    root, paths = sources
    entries, bad = parse_blend(f" 0.25:a.bin ,0.75:{paths[2]}", str(root))
    assert not bad and entries == [(0.25, str(root / "a.bin")), (0.75, str(paths[2]))]


def _train(tmp_path, *extra, run="run"):
    return main(["train", "--set", "data.source=tokens", "--set", "model.vocab_size=128", "--set", "train.steps=3",
                 "--set", "train.seq_len=16", "--set", "train.global_batch=4", *extra,
                 "--run-dir", str(tmp_path / run)])


def test_train_on_a_blend_logs_the_realised_proportions(sources, capsys):
    root, paths = sources
    rc = _train(root, "--set", f"data.path={root}", "--set", "data.blend=0.5:a.bin, 0.3:b_text_document, 0.2:c.bin",
                "--set", "data.eval_fraction=0.1", "--set", "train.eval_every=3", "--set", "train.eval_steps=1")
    err = capsys.readouterr().err
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "data.blend:" in x)
    assert "3 sources over the run's 12 sequences (3 steps x 4)" in line
    assert f"{root / 'a.bin'}: weight 0.5, realised 0.5000 (6 sequences" in line
    assert f"{root / 'b_text_document'}: weight 0.3, realised 0.3333 (4 sequences" in line
    assert f"{root / 'c.bin'}: weight 0.2, realised 0.1667 (2 sequences" in line
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and "eval_loss" in summary


@pytest.mark.parametrize("blend, expect", [
    ("0.7:a.bin, 0.2:c.bin", "data.blend weights sum to 0.9 (0.7 + 0.2), expected 1; scale them, e.g. data.blend = '0.7778:"),
    ("1.2:a.bin, -0.2:c.bin", "data.blend entry 2 ('-0.2:c.bin'): weight -0.2, expected a positive number"),
    ("0.5:a.bin, 0.5:nope.bin", "data.blend entry 2: data.path = 'ROOT/nope.bin': no such file or directory"),
    ("0.5 a.bin, 0.5:c.bin", "data.blend entry 1 ('0.5 a.bin'): not WEIGHT:PATH"),
    ("0.5:a.bin, 0.5:a.bin", "data.blend entries 1 and 2 both name"),
    ("0.99999:a.bin, 0.00001:c.bin", "weight 1e-05 is too small to draw even one sequence in 10000"),
])
def test_bad_blend_exits_2(sources, capsys, blend, expect):
    root, _ = sources
    assert _train(root, "--set", f"data.path={root}", "--set", f"data.blend={blend}") == 2
    assert expect.replace("ROOT", str(root)) in capsys.readouterr().err
    assert not (root / "run").exists()


def test_blend_needs_a_folder_for_relative_paths_and_token_data(sources, capsys):
    root, _ = sources
    assert _train(root, "--set", "data.blend=1:a.bin") == 2
    assert "'a.bin' is a relative path and data.path names no folder" in capsys.readouterr().err
    assert main(["train", "--set", "data.source=synthetic", "--set", f"data.blend=1:{root / 'a.bin'}",
                 "--run-dir", str(root / "run")]) == 2
    assert "data.blend is set but data.source = 'synthetic'" in capsys.readouterr().err


@pytest.mark.multirank
def test_blend_resume_on_one_rank_matches_two_ranks(sources):
    """2 ranks train a blend (a flat .bin, a Megatron prefix, a .bin) to step 2 with a checkpoint; 1 rank
    resumes to step 4: its losses equal the uninterrupted 2-rank run's (same tolerance argument as
    test_tokens_data.test_resume_at_another_dp_size_sees_the_same_tokens)."""
    root, _ = sources
    common = ["--set", "data.source=tokens", "--set", f"data.path={root}", "--set", "model.vocab_size=128",
              "--set", "data.blend=0.5:a.bin, 0.3:b_text_document, 0.2:c.bin",
              "--set", "train.seq_len=16", "--set", "train.global_batch=4", "--set", "train.steps=4"]
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"

    def train(run_dir, *extra):
        r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", *common, "--run-dir",
                            str(run_dir), *extra], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count("data.blend: 3 sources") == 1, "one blend line per job, not one per rank"
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    full = train(root / "full", "--nproc", "2")
    part = root / "part"
    train(part, "--nproc", "2", "--set", "train.steps=2", "--set", "train.checkpoint_every=2")
    resumed = train(part, "--nproc", "1", "--set", "parallel.micro_batches=2", "--resume", "auto")
    assert len(resumed) == 4
    np.testing.assert_allclose(resumed[2:], full[2:], rtol=1e-4)
    assert abs(resumed[3] - full[2]) > 1e-3, "different steps see different tokens"
