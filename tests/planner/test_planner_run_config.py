"""``chipset plan RUN/config.toml``: the planner reads the config a run wrote (docs/planner.md).

Each run is real (``chipset train --set train.steps=1``, one process): the default decoder, a
mixture-of-experts model and a Hugging Face-initialised Llama. The planner must plan the model
the run trained (the same parameter count), at the run's batch, sequence length and dtype, and
refuse the families it cannot describe with exit 2.
"""

from __future__ import annotations

import json
import re

import pytest

from chipset.cli.main import main
from conftest import run_cli

CLUSTER = "4x8:h100-sxm"
LLAMA = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64)


def _train(run_dir, *sets: str) -> int:
    """Train one step into ``run_dir``; the number of parameters the run built."""
    r = run_cli("train", "--set", "train.steps=1", *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr
    return int(re.search(r"([\d,]+) params", r.stdout).group(1).replace(",", ""))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {"default": _train(root / "default"),
           "moe": _train(root / "moe", "model.num_experts=4", "model.num_experts_per_tok=2")}
    transformers = pytest.importorskip("transformers")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    out["hf"] = _train(root / "hf", f"model.init_from={root / 'llama'}")
    return root, out


def _plan(capsys, *args):
    rc = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("run", ["default", "moe", "hf"])
def test_a_run_config_plans_the_model_the_run_trained(runs, capsys, run):
    from chipset.planner.model_file import load_model_toml

    root, params = runs
    config = root / run / "config.toml"
    assert load_model_toml(config).num_params() == params[run]
    rc, out, err = _plan(capsys, config, "--cluster", CLUSTER, "--top", "1")
    assert rc == 0, err
    # the run's own train.global_batch (8), seq_len (16) and dtype (float32), not the planner's defaults
    assert f"model {run if run != 'hf' else 'llama'}: " in out and "seq 16, global batch 8 sequences" in out
    assert "TFLOP/s float32" in out
    rc, out2, err = _plan(capsys, "--model", config, "--cluster", CLUSTER, "--top", "1")
    assert rc == 0 and out2 == out, err


def test_flags_override_the_config_and_say_so(runs, capsys):
    root, _ = runs
    rc, out, err = _plan(capsys, root / "default" / "config.toml", "--cluster", CLUSTER, "--global-batch", "64",
                         "--seq-len", "32", "--dtype", "bfloat16", "--top", "1")
    assert rc == 0, err
    assert "seq 32, global batch 64 sequences" in out and "TFLOP/s bfloat16" in out
    for flag, key, old in (("--global-batch 64", "global_batch", "8"), ("--seq-len 32", "seq_len", "16"),
                           ("--dtype bfloat16", "dtype", "'float32'")):
        assert f"chipset plan: {flag} replaces train.{key} = {old} of " in err


def test_write_config_keeps_the_run_dtype_and_batch(runs, capsys, tmp_path):
    from chipset.train.config import resolve_config

    root, _ = runs
    out = tmp_path / "plan.toml"
    rc, stdout, err = _plan(capsys, root / "hf" / "config.toml", "--cluster", "1x8:h100-sxm", "--json", "--top", "1",
                            "--write-config", out)
    assert rc == 0, err
    top = json.loads(stdout)[0]
    cfg = resolve_config(out, None, world_size=8)
    assert (cfg.train.dtype, cfg.train.global_batch, cfg.train.seq_len) == ("float32", 8, 16)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (top["tp"], top["pp"], top["dp"])
    assert cfg.model.init_from == str(root / "llama") and cfg.model.architecture == "LlamaForCausalLM"
    rc, _, err = _plan(capsys, root / "default" / "config.toml", "--cluster", "1x8:h100-sxm", "--dtype", "bfloat16",
                       "--write-config", tmp_path / "bf16.toml")
    assert rc == 0 and "--dtype bfloat16 replaces train.dtype = 'float32'" in err
    assert resolve_config(tmp_path / "bf16.toml", None, world_size=8).train.dtype == "bfloat16"


def test_families_the_planner_cannot_describe_exit_2(tmp_path, capsys):
    _train(tmp_path / "resnet", "model.family=resnet", "model.num_classes=10")
    custom = tmp_path / "custom.toml"
    custom.write_text('[model]\nfamily = "my_models:factory"\nhidden_size = 64\n')
    for config, family in ((tmp_path / "resnet" / "config.toml", "resnet"), (custom, "my_models:factory")):
        rc, _, err = _plan(capsys, config, "--cluster", CLUSTER)
        assert rc == 2
        assert f"model.family = {family!r}: the planner describes the built-in decoder only" in err
        assert "chipset plan --module package.module:factory" in err


def test_a_config_and_model_flag_together_exit_2(runs, capsys):
    root, _ = runs
    rc, _, err = _plan(capsys, root / "default" / "config.toml", "--preset", "tiny", "--cluster", CLUSTER)
    assert rc == 2 and "both name the model; give one" in err
