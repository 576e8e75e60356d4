"""``chipset plan --write-config``: the best layout becomes a config chipset train accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forked_cli
from chipset.train.config import resolve_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "1x8:h100-sxm"


def _plan(*args: str) -> subprocess.CompletedProcess:
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "plan", *args], capture_output=True, text=True,
                          timeout=300)


def _check_matches_top(out: Path, top: dict, world: int) -> None:
    cfg = resolve_config(out, None, world_size=world)  # what chipset train runs before launching
    par = cfg.parallel
    assert (par.dp, par.tp, par.pp, par.ep, par.cp, par.zero) == (
        top["dp"], top["tp"], top["pp"], top["ep"], top["cp"], top["zero"])
    assert par.dp * par.tp * par.pp * par.cp == world
    assert cfg.train.global_batch // (par.dp * par.micro_batches) == top["micro_batch"]
    assert cfg.train.recompute == top["recompute"]


def test_llama_config_round_trips_through_train_loader(tmp_path):
    out = tmp_path / "plan.toml"
    # pin unequal tp and pp so a swapped mapping cannot pass
    fix = "parallel.tp=4,parallel.pp=2"
    r = _plan("--model", str(ROOT / "examples/llama-1b.toml"), "--cluster", CLUSTER, "--fix", fix,
              "--json", "--top", "1", "--write-config", str(out))
    assert r.returncode == 0, r.stderr
    top = json.loads(r.stdout)[0]
    assert (top["tp"], top["pp"], top["dp"]) == (4, 2, 1)
    _check_matches_top(out, top, 8)
    text = out.read_text()
    assert "--nproc 8" in text and "rope_theta = 500000.0" in text
    cfg = resolve_config(out, None, world_size=8)
    assert (cfg.train.steps, cfg.train.lr) == (1000, 3e-4)  # the source's run settings carried over


def test_preset_writes_architecture_keys(tmp_path):
    out = tmp_path / "tiny.toml"
    r = _plan("--preset", "tiny", "--cluster", CLUSTER, "--global-batch", "16", "--json", "--top", "1",
              "--write-config", str(out))
    assert r.returncode == 0, r.stderr
    top = json.loads(r.stdout)[0]
    _check_matches_top(out, top, 8)
    cfg = resolve_config(out, None, world_size=8)
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.num_key_value_heads) == (64, 2, 2)


def test_existing_file_is_refused_and_untouched(tmp_path):
    out = tmp_path / "plan.toml"
    out.write_text("keep me\n")
    r = _plan("--preset", "tiny", "--cluster", CLUSTER, "--global-batch", "16", "--write-config", str(out))
    assert r.returncode == 2 and "--force" in r.stderr
    assert out.read_text() == "keep me\n"
    r = _plan("--preset", "tiny", "--cluster", CLUSTER, "--global-batch", "16", "--write-config", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert "[parallel]" in out.read_text()


def test_model_train_cannot_build_is_refused(tmp_path):
    out = tmp_path / "gpt3.toml"
    r = _plan("--preset", "gpt3-175b", "--cluster", "128x8:h100-sxm", "--write-config", str(out))
    assert r.returncode == 2 and "gelu" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_hf_config_is_carried_not_restated(tmp_path):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    out = tmp_path / "hf.toml"
    r = _plan("--model", str(tmp_path / "m"), "--cluster", CLUSTER, "--global-batch", "16", "--json", "--top", "1",
              "--write-config", str(out))
    assert r.returncode == 0, r.stderr
    _check_matches_top(out, json.loads(r.stdout)[0], 8)
    assert "hidden_size" not in out.read_text()  # the architecture comes from config.json
    cfg = resolve_config(out, None, world_size=8)
    assert cfg.model.hf_config == str((tmp_path / "m" / "config.json").resolve())
    assert (cfg.model.hidden_size, cfg.train.seq_len) == (64, 512)
