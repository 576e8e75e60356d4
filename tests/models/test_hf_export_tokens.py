"""``chipset export --format hf`` carries the model's special-token ids, ``generation_config.json``
and tokenizer (issue 37), and ``chipset train`` warns when the data's tokenizer is not the model's.

transformers is the reference: each export is loaded from its folder, offline, with
AutoModelForCausalLM / AutoTokenizer / GenerationConfig. The tiny model's special ids are
deliberately not transformers' Llama defaults (bos 1, eos 2, pad none): eos 0, pad 1, bos 2, so
an export that drops them is seen (transformers would fall back to eos 2 and ``generate()``
would not stop at 0). Every run here is one process (``chipset train`` in this process).
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat

import pytest
import torch

from chipset.cli.main import main

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

SPECIALS = ["</s>", "<pad>", "<s>", "<unk>"]  # ids 0..3: eos 0, pad 1, bos 2
IDS = {"bos_token_id": 2, "eos_token_id": 0, "pad_token_id": 1}
WORDS = "the quick brown fox jumps over lazy dog chip train model layer token shard rank".split()
SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def _texts(seed: int, n: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(n)]


def _bpe(texts: list[str], vocab: int = 100):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS))
    return tok


def _prepare(corpus, tokenizer, out) -> None:
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
                 "--workers", "1"]) == 0


def _train(run_dir, *sets: str) -> None:
    args = [a for s in ("train.steps=2", "train.checkpoint_every=2", "train.seq_len=16", *sets) for a in ("--set", s)]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Llama directory as transformers writes one (config, weights, generation config, tokenizer),
    a JSONL corpus and that corpus prepared with the model's own tokenizer."""
    root = tmp_path_factory.mktemp("src")
    texts = _texts(0)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    model = root / "model"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(texts), bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(model)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **IDS)).save_pretrained(model)
    # Not what transformers derives from config.json: the copy must be this file, not a default.
    transformers.GenerationConfig(**IDS, max_new_tokens=7, do_sample=False, repetition_penalty=1.25) \
        .save_pretrained(model)
    tokens = root / "tokens"
    _prepare(corpus, model, tokens)
    return root, model, corpus, tokens


def _zero_head_generate(out) -> torch.Tensor:
    """Greedy generation from the export with a zero output layer: every logit ties, argmax is id 0
    (the eos here), so a model that knows its eos stops after one new token."""
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.zero_()
        return m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)[0]


def test_export_after_finetuning_carries_ids_generation_config_and_tokenizer(src, tmp_path, capsys):
    root, model, corpus, tokens = src
    run, out = tmp_path / "run", tmp_path / "export"
    _train(run, f"model.init_from={model}", "data.source=tokens", f"data.path={tokens}")
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    cfg = transformers.AutoConfig.from_pretrained(out)
    assert {k: getattr(cfg, k) for k in IDS} == IDS
    gen = transformers.GenerationConfig.from_pretrained(out)
    want = transformers.GenerationConfig.from_pretrained(model)
    assert gen.to_dict() == want.to_dict() and gen.max_new_tokens == 7 and gen.repetition_penalty == 1.25
    tok, ref = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(model)
    text = _texts(1, 1)[0]
    assert tok(text).input_ids == ref(text).input_ids
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 2, 1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (model / name).read_bytes(), name
    assert "eos_token_id=0" in printed and "tokenizer" in printed and str(model) in printed, printed

    new = _zero_head_generate(out)
    assert new.tolist() == [5, 6, 7, 0], "generate() must stop at the model's eos (0)"


def test_export_of_a_run_on_prepared_tokens_takes_the_tokenizer_and_eos_from_the_data(src, tmp_path, capsys):
    """No init_from: the tokenizer the data was prepared with (recorded in meta.json) and its EOS id."""
    root, _, corpus, _ = src
    bare = tmp_path / "tok"  # a tokenizer.json alone, as `chipset data prepare --tokenizer FILE` takes it
    bare.mkdir()
    ref = _bpe(_texts(0))
    ref.save(str(bare / "tokenizer.json"))
    tokens, run, out = tmp_path / "tokens", tmp_path / "run", tmp_path / "export"
    _prepare(corpus, bare / "tokenizer.json", tokens)
    assert json.loads((tokens / "meta.json").read_text())["eos_id"] == 0
    _train(run, "data.source=tokens", f"data.path={tokens}")
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    hf = json.loads((out / "config.json").read_text())
    assert hf["eos_token_id"] == 0 and "bos_token_id" not in hf and "pad_token_id" not in hf, hf
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = _texts(2, 1)[0]
    assert tok(text, add_special_tokens=False).input_ids == ref.encode(text, add_special_tokens=False).ids
    assert tok.eos_token == "</s>" and tok.eos_token_id == 0
    assert (out / "tokenizer.json").read_bytes() == (bare / "tokenizer.json").read_bytes()
    assert "eos_token_id=0" in printed and "meta.json" in printed, printed
    # No generation_config.json: transformers derives it from config.json, eos included.
    assert _zero_head_generate(out).tolist() == [5, 6, 7, 0]


def test_export_with_nothing_known_writes_no_ids_and_says_so(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "export"
    _train(run)  # synthetic data, no init_from: no tokenizer anywhere
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    hf = json.loads((out / "config.json").read_text())
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(hf), hf
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "no special-token ids" in printed and "no tokenizer" in printed, printed


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_exported_files_are_readable_by_everyone_as_umask_allows(src, tmp_path, fmt):
    """Like `cp`: the folder 0o777 & ~umask, the files 0o666 & ~umask (not mkdtemp's and safetensors' 0600)."""
    _, model, _, _ = src
    run, out = tmp_path / "run", tmp_path / "export"
    _train(run, f"model.init_from={model}")
    old = os.umask(0o022)
    try:
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert files and all(m == 0o644 for m in files.values()), files


# --- the data's tokenizer against the model's ----------------------------------------------


@pytest.fixture
def warnings_seen():
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("chipset"), _Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def _resolve(*sets: str):
    from chipset.train.config import resolve_config

    return resolve_config(None, list(sets), world_size=1)


def test_tokens_prepared_with_another_tokenizer_warn_once(src, tmp_path, warnings_seen):
    root, model, corpus, tokens = src
    _resolve(f"model.init_from={model}", "data.source=tokens", f"data.path={tokens}")
    assert warnings_seen == [], "the model's own tokenizer: nothing to say"

    other = tmp_path / "other"
    other.mkdir()
    _bpe(_texts(7), vocab=80).save(str(other / "tokenizer.json"))
    theirs = tmp_path / "theirs"
    _prepare(corpus, other / "tokenizer.json", theirs)
    _resolve(f"model.init_from={model}", "data.source=tokens", f"data.path={theirs}")
    assert len(warnings_seen) == 1, warnings_seen
    w = warnings_seen[0]
    assert str(other / "tokenizer.json") in w and str(model) in w and "--tokenizer" in w, w


def test_a_model_without_tokenizer_warns_when_the_vocabularies_differ(src, tmp_path, warnings_seen):
    root, model, corpus, _ = src
    bare = tmp_path / "model"  # the same model without its tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model / name).read_bytes())
    other = tmp_path / "other"
    other.mkdir()
    _bpe(_texts(7), vocab=80).save(str(other / "tokenizer.json"))
    theirs = tmp_path / "theirs"
    _prepare(corpus, other / "tokenizer.json", theirs)
    vocab = json.loads((theirs / "meta.json").read_text())["vocab_size"]
    _resolve(f"model.init_from={bare}", "data.source=tokens", f"data.path={theirs}")
    assert len(warnings_seen) == 1 and f"vocabulary of {vocab}" in warnings_seen[0] \
        and "model.vocab_size = 128" in warnings_seen[0], warnings_seen


def test_raw_bytes_into_a_pretrained_model_warn(src, tmp_path, warnings_seen):
    _, model, corpus, _ = src
    wide = tmp_path / "model"  # data.source = 'text' needs 256 ids; resolving the config reads no weights
    wide.mkdir()
    hf = json.loads((model / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**hf, "vocab_size": 256}))
    for name in ("model.safetensors", "tokenizer.json"):
        (wide / name).write_bytes((model / name).read_bytes())
    _resolve(f"model.init_from={wide}", "data.source=text", f"data.path={corpus}")
    assert len(warnings_seen) == 1 and "chipset data prepare" in warnings_seen[0] \
        and f"--tokenizer {wide}" in warnings_seen[0], warnings_seen
    warnings_seen.clear()
    _resolve("data.source=text", f"data.path={corpus}", "model.vocab_size=256")  # from scratch: bytes are its ids
    assert warnings_seen == []


def test_the_example_fine_tunes_on_tokens_prepared_with_the_model_tokenizer(src):
    """examples/hf-finetune.toml with a model directory and its prepared tokens: a valid 2-rank config."""
    from pathlib import Path

    from chipset.train.config import resolve_config

    _, model, _, tokens = src
    example = Path(__file__).resolve().parents[2] / "examples" / "hf-finetune.toml"
    text = example.read_text()
    assert 'source = "tokens"' in text and "chipset data prepare" in text and "--tokenizer" in text
    cfg = resolve_config(example, [f"model.init_from={model}", f"data.path={tokens}", "train.seq_len=32"],
                         world_size=2)
    assert cfg.data.source == "tokens" and cfg.model.vocab_size == 128


# --- what is carried, case by case (no training: carry_tokenizer reads only the files) --------


def _run_config(**sections):
    from chipset.train.config import RunConfig

    return RunConfig.from_dict(sections)


def test_a_changed_or_missing_data_tokenizer_is_not_exported_and_a_different_eos_is_noted(src, tmp_path):
    from chipset.train.checkpoint.export import carry_tokenizer

    _, model, _, tokens = src
    meta = json.loads((tokens / "meta.json").read_text())
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_bytes((model / "tokenizer.json").read_bytes() + b" ")  # not the file the data was made with
    folder = tmp_path / "tokens"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({**meta, "eos_id": 3, "tokenizer": {**meta["tokenizer"],
                                                                                      "file": str(tok)}}))
    c = carry_tokenizer(_run_config(model={"init_from": str(model)}, data={"source": "tokens", "path": str(folder)}))
    assert c.ids == IDS and c.files["tokenizer.json"] == model / "tokenizer.json", c
    notes = "\n".join(c.notes)
    assert f"{tok} changed after `chipset data prepare`" in notes and "end-of-document id 3" in notes, notes

    tok.unlink()
    c = carry_tokenizer(_run_config(data={"source": "tokens", "path": str(folder)}))
    assert c.ids == {"eos_token_id": 3} and not c.files and c.tokenizer_config is None, c
    assert "no longer exists" in c.notes[1] and "no tokenizer known" in c.notes[-1], c.notes


def test_hf_config_gives_its_special_ids(src):
    from chipset.train.checkpoint.export import carry_tokenizer

    _, model, _, _ = src
    c = carry_tokenizer(_run_config(model={"hf_config": str(model / "config.json")}))
    assert c.ids == IDS and not c.files and "no tokenizer known" in c.notes[-1], c
