"""Forgiving input: dtype aliases, 'did you mean' for keys, sections, commands and options, and layout
errors that say which --nproc would work."""

from __future__ import annotations

import pytest

from chipset.cli.main import main
from chipset.train.config import load_config


@pytest.mark.parametrize("alias, name", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_dtype_aliases(alias, name):
    assert load_config(None, [f"train.dtype={alias}"]).train.dtype == name


@pytest.mark.parametrize("argv, expect", [
    (["train", "--set", "train.stesp=3"], "train.stesp: unknown key (value 3) (did you mean 'steps'?)"),
    (["train", "--set", "trian.steps=3"], "[trian]: unknown section (did you mean 'train'?)"),
    (["trian"], "(did you mean: 'trian' -> 'train'?)"),
    (["train", "--nprc", "2"], "(did you mean: '--nprc' -> '--nproc'?)"),
    (["train", "--set", "parallel.tp=2"], "tp*pp*cp (2) must divide world size (1); run with a multiple of 2 ranks, e.g. --nproc 2"),
    (["train", "--set", "parallel.dp=3", "--nproc", "2"], "run with --nproc 3 (or set parallel.dp = 0"),
])
def test_mistakes_get_a_suggestion_and_exit_2(tmp_path, capsys, argv, expect):
    try:
        rc = main([*argv, "--run-dir", str(tmp_path / "run")] if argv[0] == "train" else argv)
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    assert rc == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
