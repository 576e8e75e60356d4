"""chipset's MoE keys carry Hugging Face's names (num_experts_per_tok, router_aux_loss_coef).

The old names (top_k, aux_loss_coef) are still read for one release, with a warning, from a
config file, ``--set`` and a run directory saved before the rename; giving one key under both
names is refused (exit 2), since which value wins would be a guess.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import forked_cli
import testenv  # noqa: E402
from chipset.errors import ConfigError  # noqa: E402
from chipset.train.config import RunConfig, load_config  # noqa: E402

OLD_TO_NEW = {"top_k": "num_experts_per_tok", "aux_loss_coef": "router_aux_loss_coef"}


def _chipset(*args, cwd=None):
    e = testenv.clean_env(keep_settings=True)
    e["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=600)


def test_new_names_set_the_moe_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nnum_experts = 4\nnum_experts_per_tok = 3\nrouter_aux_loss_coef = 0.25\n")
    m = load_config(f).model
    assert (m.num_experts_per_tok, m.router_aux_loss_coef) == (3, 0.25)
    m = load_config(None, ["model.num_experts_per_tok=2", "model.router_aux_loss_coef=0.5"]).model
    assert (m.num_experts_per_tok, m.router_aux_loss_coef) == (2, 0.5)


def test_old_names_are_accepted_with_a_deprecation_warning(tmp_path, caplog):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nnum_experts = 4\ntop_k = 3\naux_loss_coef = 0.25\n")
    with caplog.at_level(logging.WARNING, logger="chipset"):
        m = load_config(f).model
    assert (m.num_experts_per_tok, m.router_aux_loss_coef) == (3, 0.25)
    text = caplog.text
    for old, new in OLD_TO_NEW.items():
        assert f"model.{old} is deprecated" in text and f"use model.{new}" in text, text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chipset"):
        m = load_config(None, ["model.top_k=2"]).model
    assert m.num_experts_per_tok == 2 and "--set: model.top_k is deprecated" in caplog.text
    # A dict (a checkpoint's saved config) goes through the same path.
    assert RunConfig.from_dict({"model": {"top_k": 2}}).model.num_experts_per_tok == 2


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_one_key_under_both_names_is_refused(tmp_path, old):
    new = OLD_TO_NEW[old]
    f = tmp_path / "c.toml"
    f.write_text(f"[model]\nnum_experts = 4\n{old} = 2\n{new} = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.exit_code == 2
    assert f"model.{old} and model.{new} both given" in str(err.value), err.value
    assert f"keep only model.{new}" in str(err.value)
    with pytest.raises(ConfigError, match=f"model.{old} and model.{new} both given"):
        load_config(None, [f"model.{old}=2", f"model.{new}=1"])
    # Through the command line: exit 2 before anything is written.
    run_dir = tmp_path / "run"
    r = _chipset("train", str(f), "--run-dir", str(run_dir))
    assert r.returncode == 2 and "both given" in r.stderr, r.stderr
    assert not run_dir.exists()


def test_planner_set_takes_the_train_name(tmp_path):
    from chipset.planner.model import ModelSpec, apply_model_overrides

    base = ModelSpec(num_experts=8)
    assert apply_model_overrides(base, ["model.num_experts_per_tok=3"]).top_k == 3
    assert apply_model_overrides(base, ["model.top_k=3"]).top_k == 3  # the planner's own short name
    with pytest.raises(ConfigError, match="both .num_experts_per_tok. and .top_k. given"):
        apply_model_overrides(base, ["model.top_k=3", "model.num_experts_per_tok=2"])


def _to_old_names(run_dir: Path) -> int:
    """Rewrite a run directory as chipset before the rename wrote it; returns the files changed."""
    changed = 0
    toml = run_dir / "config.toml"
    text = toml.read_text()
    for old, new in OLD_TO_NEW.items():
        text = text.replace(f"\n{new} =", f"\n{old} =")
    toml.write_text(text)
    for state in run_dir.rglob("state.json"):
        data = json.loads(state.read_text())
        model = data["config"]["model"]
        for old, new in OLD_TO_NEW.items():
            model[old] = model.pop(new)
        state.write_text(json.dumps(data))
        # The manifest's checksum of state.json, as the old writer would have recorded it.
        manifest = state.parent / "manifest.json"
        man = json.loads(manifest.read_text())
        man["files"]["state.json"] = {"bytes": state.stat().st_size,
                                      "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
        manifest.write_text(json.dumps(man))
        changed += 1
    return changed


def test_a_run_directory_saved_with_old_names_resumes(tmp_path):
    """Resuming compares the saved config with the new one key by key: the old name and the new one
    are the same key, so an unchanged value resumes and a changed one is refused."""
    run = tmp_path / "run"
    common = ["--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2", "--set", "train.seq_len=16",
              "--set", "train.global_batch=2", "--set", "train.checkpoint_every=2"]
    r = _chipset("train", *common, "--set", "train.steps=2", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert _to_old_names(run) >= 1
    assert "top_k = 2" in (run / "config.toml").read_text()
    # A different top-k under the new name: the same key as the saved top_k, so the resume is refused.
    r = _chipset("train", str(run / "config.toml"), "--set", "train.steps=4", "--set", "model.num_experts_per_tok=1",
                 "--run-dir", str(run))
    assert r.returncode == 2 and "model.num_experts_per_tok: 2 -> 1" in r.stderr, r.stderr
    r = _chipset("train", str(run / "config.toml"), "--set", "train.steps=4", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "model.top_k is deprecated" in r.stderr
    assert "resum" in (r.stdout + r.stderr).lower()
    # The run directory is rewritten under the new names.
    assert "num_experts_per_tok = 2" in (run / "config.toml").read_text()
