"""chipset generate: a checkpoint sampled in one process, with the KV cache of models/sampling.py."""

from __future__ import annotations

import json

import pytest
import torch

from chipset.cli.main import main

SMALL = ["model.num_hidden_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "train.seq_len=32",
         "train.global_batch=4", "train.steps=3", "train.checkpoint_every=3"]


def _train(run_dir, *sets):
    argv = ["train", *[x for s in [*SMALL, *sets] for x in ("--set", s)], "--run-dir", str(run_dir)]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "text"
    _train(run, "data.source=text", "model.vocab_size=256")
    return run


def _generate(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_completion_equals_argmax_decoding_without_the_cache(text_run, capsys):
    """The cached sampler against the plainest decoder: the whole forward on the growing sequence."""
    from chipset.loader import backend
    from chipset.models.family import build_for
    from chipset.models.registry import resolve_family
    from chipset.train.checkpoint.export import load_weights

    code, out, _ = _generate(capsys, text_run, "--prompt", "def ", "--max-new-tokens", 12, "--greedy", "--json")
    assert code == 0
    got = json.loads(out)
    assert got["tokenizer"] == "bytes" and got["prompt_ids"] == list(b"def ")
    cfg, weights, ckpt = load_weights(text_run)
    # the weights read are the trained ones: the run's own layout-independent digest of its final parameters
    from chipset.runtime.digest import params_digest

    names = json.loads((ckpt / "state.json").read_text())["shapes"]
    digest = params_digest({n: weights[n] for n in names})
    assert digest == json.loads((text_run / "summary.json").read_text())["params_digest"]
    fam = resolve_family(cfg.model.family)
    model = build_for(fam, cfg, backend().kernels)
    model.load_state_dict(weights)
    model.eval()
    seq = torch.tensor([list(b"def ")])
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    want = seq[0, 4:].tolist()
    assert got["completions"][0]["ids"] == want
    assert got["completions"][0]["text"] == bytes(want).decode("utf-8", errors="replace")


def test_the_same_seed_gives_the_same_completions(text_run, capsys):
    runs = [_generate(capsys, text_run, "--prompt", "im", "--max-new-tokens", 8, "--num", 3, "--seed", s, "--json")
            for s in (7, 7, 8)]
    ids = [[c["ids"] for c in json.loads(out)["completions"]] for _, out, _ in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


@pytest.mark.parametrize("argv, expect", [
    (["--prompt-ids", "1,999"], "outside the model's vocabulary 0..255"),
    (["--prompt", "x", "--prompt-ids", "1"], "give exactly one of --prompt TEXT or --prompt-ids"),
    (["--prompt", "x", "--temperature", "0"], "--temperature (0.0) must be > 0"),
    (["--prompt", "x", "--step", "2"], "--step 2:"),
])
def test_bad_input_is_exit_2(text_run, capsys, argv, expect):
    code, _, err = _generate(capsys, text_run, *argv)
    assert code == 2 and expect in err


def test_a_run_without_a_tokenizer_takes_ids_and_a_classifier_is_refused(tmp_path, capsys):
    _train(tmp_path / "synthetic")
    code, _, err = _generate(capsys, tmp_path / "synthetic", "--prompt", "hello")
    assert code == 2 and "give the prompt as token ids with --prompt-ids" in err
    code, out, _ = _generate(capsys, tmp_path / "synthetic", "--prompt-ids", "1,2,3", "--max-new-tokens", 4)
    assert code == 0 and out.startswith("1 2 3 ")
    _train(tmp_path / "resnet", 'model.family="resnet"', "model.num_classes=3")
    code, _, err = _generate(capsys, tmp_path / "resnet", "--prompt-ids", "1")
    assert code == 2 and "model family 'resnet' does not produce tokens" in err
