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


def test_dtype_auto_is_the_backends_default_and_the_run_records_the_dtype_used(tmp_path):
    """train.dtype = "auto" (examples/tiny.toml): the backend's Capabilities.default_dtype, written
    resolved into the run's config.toml so a resume, `chipset plan` and the report see the real one."""
    import tomllib

    from chipset.loader import backend
    from chipset.train.config import resolve_config, resolve_dtype

    default = backend().capabilities.default_dtype
    assert resolve_config(None, ["train.dtype=auto"], world_size=1, default_dtype="bfloat16").train.dtype == "bfloat16"
    assert resolve_dtype(load_config(None, ["train.dtype=auto"]), "float16").train.dtype == "float16"
    assert load_config(None, []).train.dtype == "float32", "the default stays float32, not auto"
    rc = main(["train", "--set", "train.dtype=auto", "--set", "train.steps=1", "--set", "model.num_hidden_layers=1",
               "--set", "model.hidden_size=32", "--set", "model.num_attention_heads=2", "--set", "model.vocab_size=64",
               "--set", "train.seq_len=8", "--set", "train.global_batch=2", "--run-dir", str(tmp_path / "run")])
    assert rc == 0
    written = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert written["train"]["dtype"] == default


def test_start_banner_counts_the_whole_model_and_what_rank_0_holds():
    """ZeRO-3 printed the whole model, tp/pp rank 0's share, both as "params": now both numbers."""
    from types import SimpleNamespace

    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family
    from chipset.parallel.dims import ParallelDims
    from chipset.train.loop import param_line

    cfg = load_config(None, ["model.num_hidden_layers=2", "model.hidden_size=32", "model.num_attention_heads=2"])
    model = meta_model(resolve_family("transformer"), cfg)
    total = sum(p.numel() for p in model.parameters())
    engine = SimpleNamespace(model=model)
    assert param_line(cfg, engine, ParallelDims(dp=1, world_size=1)) == f"{total:,} params"
    zero3 = ParallelDims(dp=2, zero=3, world_size=2)
    assert param_line(cfg, engine, zero3) == f"{total:,} params ({-(-total // 2):,} on rank 0)"
    stage = SimpleNamespace(model=model.layers[0])  # a pipeline stage's share
    held = sum(p.numel() for p in model.layers[0].parameters())
    assert param_line(cfg, stage, ParallelDims(dp=1, pp=2, world_size=2)) == f"{total:,} params ({held:,} on rank 0)"
