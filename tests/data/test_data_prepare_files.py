"""``chipset data prepare`` on folders of mixed files: what is read, what is skipped and said so, ``--ext``."""

from __future__ import annotations

import json

import pytest

from chipset.cli.main import main
from chipset.data.prepare import INPUT_SUFFIXES

pytest.importorskip("tokenizers")

DOCS = {"a.txt": "the model trains on text", "b.md": "# notes on the model",
        "c.py": "def train(model): return model", "d.py": "import os\nprint(os.getcwd())",
        "e.py": "x = 1", "setup.cfg": "[metadata]\nname = x", "LICENSE": "permission is granted"}


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS.values(), trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "pkg").mkdir(parents=True)
    for name, text in DOCS.items():
        (folder / ("pkg" if name.endswith(".py") else "") / name).write_text(text)
    return folder, _tokenizer(tmp_path)


def _prepare(tmp_path, *args):
    return main(["data", "prepare", *map(str, args), "--out", str(tmp_path / "out"), "--workers", "1"])


def _inputs(tmp_path):
    return [p.split("/")[-1] for p in json.loads((tmp_path / "out" / "meta.json").read_text())["inputs"]]


def test_a_folder_says_which_files_it_skipped_by_extension(tmp_path, corpus, capsys):
    folder, tok = corpus
    assert _prepare(tmp_path, folder, "--tokenizer", tok) == 0
    err = capsys.readouterr().err
    assert _inputs(tmp_path) == ["a.txt", "b.md"]
    assert "skipped 5 file(s) in input folders by extension (.py: 3, (no extension): 1, .cfg: 1)" in err
    assert f"read only {','.join(INPUT_SUFFIXES)}" in err
    assert f"--ext {','.join(INPUT_SUFFIXES)},.py" in err


def test_ext_chooses_the_extensions_read_from_folders(tmp_path, corpus, capsys):
    folder, tok = corpus
    assert _prepare(tmp_path, folder, "--tokenizer", tok, "--ext", ".py, txt,.PY") == 0
    assert _inputs(tmp_path) == ["a.txt", "c.py", "d.py", "e.py"]
    assert "skipped 3 file(s) in input folders by extension ((no extension): 1, .cfg: 1, .md: 1)" in capsys.readouterr().err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["documents"] == 4


def test_a_file_named_on_its_own_is_read_as_text_whatever_its_extension(tmp_path, corpus, capsys):
    folder, tok = corpus
    assert _prepare(tmp_path, folder / "pkg" / "c.py", folder / "LICENSE", "--tokenizer", tok) == 0
    assert _inputs(tmp_path) == ["c.py", "LICENSE"]
    assert "skipped" not in capsys.readouterr().err


def test_a_binary_file_named_on_its_own_is_refused(tmp_path, corpus, capsys):
    _, tok = corpus
    (tmp_path / "train.bin").write_bytes(bytes([1, 0, 2, 0]))
    assert _prepare(tmp_path, tmp_path / "train.bin", "--tokenizer", tok) == 2
    err = capsys.readouterr().err
    assert "'" + str(tmp_path / "train.bin") + "' is not text" in err and "data.source = 'tokens'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, expect", [
    (["--ext", " , "], "--ext ' , ' names no extension; give a comma-separated list"),
    (["--ext", ".rst"], "holds no .rst files (it holds .py: 3, (no extension): 1, .cfg: 1, .md: 1, .txt: 1); "
                        "choose the extensions to read with --ext"),
])
def test_bad_ext_exits_2_and_writes_nothing(tmp_path, corpus, capsys, args, expect):
    folder, tok = corpus
    assert _prepare(tmp_path, folder, "--tokenizer", tok, *args) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_the_help_names_the_default_extensions(capsys):
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    assert ",".join(INPUT_SUFFIXES) in " ".join(capsys.readouterr().out.split())
