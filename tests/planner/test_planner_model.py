"""The planner's model spec: presets reproduce published parameter counts; TOML and --set land in it."""

from __future__ import annotations

import pytest

from chipset.errors import ConfigError
from chipset.planner.model import (
    PRESETS,
    ModelSpec,
    apply_model_overrides,
    from_engine_model_config,
)
from chipset.planner.model_file import load_model_toml


@pytest.mark.parametrize(("name", "published"), [
    # Exact counts of the released checkpoints (Hugging Face model cards / safetensors index).
    ("llama2-7b", 6_738_415_616),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
])
def test_presets_match_released_parameter_counts_exactly(name, published):
    assert PRESETS[name].num_params() == published


def test_gpt3_matches_narayanan_equation_2_plus_the_final_layernorm():
    m = PRESETS["gpt3-175b"]
    L, h, V, s = m.layers, m.hidden, m.vocab, m.seq_len
    eq2 = 12 * L * h**2 + 13 * L * h + (V + s) * h  # 12lh^2 (1 + 13/12h + (V+s)/12lh), expanded
    assert m.num_params() == eq2 + 2 * h
    assert abs(m.num_params() / 175e9 - 1) < 0.003  # "175B"; Narayanan et al. Table 2 prints 174.6


def test_moe_counts_all_experts_and_active_ones_separately():
    m = PRESETS["mixtral-8x7b"]
    assert round(m.num_params() / 1e9, 1) == 46.7  # Jiang et al. 2024: 47B total, 13B active
    assert round(m.active_params() / 1e9, 1) == 12.9
    assert m.expert_params() == 32 * 8 * 3 * 4096 * 14336


def test_toml_file_and_overrides_land_in_the_spec(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[model]\npreset = "llama2-7b"\nlayers = 16\ntied_embeddings = true\n')
    m = load_model_toml(f)
    assert (m.layers, m.hidden, m.tied_embeddings) == (16, 4096, True)
    m2 = apply_model_overrides(m, ["model.hidden=2048", "model.mlp=gelu", "model.tied_embeddings=false"])
    assert (m2.hidden, m2.mlp, m2.tied_embeddings, m2.ffn) == (2048, "gelu", False, 11008)


@pytest.mark.parametrize(("content", "match"), [
    ("[model]\nlayerz = 3\n", "unknown model key"),
    ("[model]\nlayers = 'many'\n", "expected int"),
    ("[other]\n", "no \\[model\\] table"),
    ("[model\n", "not valid TOML"),
])
def test_bad_model_files_raise_config_errors_that_name_the_problem(tmp_path, content, match):
    f = tmp_path / "bad.toml"
    f.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_model_toml(f)


def test_validate_names_every_inconsistent_field():
    with pytest.raises(ConfigError) as e:
        ModelSpec(hidden=100, heads=3, kv_heads=2).validate()
    assert "heads (3) must divide model.hidden (100)" in str(e.value)
    with pytest.raises(ConfigError, match="--set"):
        apply_model_overrides(ModelSpec(), ["layers=3"])


def test_engine_config_adapter_maps_hugging_face_names():
    class Cfg:
        vocab_size, hidden_size, num_hidden_layers = 128, 32, 2
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 0, 64

    m = from_engine_model_config(Cfg(), seq_len=64)
    assert (m.vocab, m.hidden, m.layers, m.heads, m.kv, m.ffn, m.seq_len) == (128, 32, 2, 4, 4, 64, 64)
    assert m.num_params() == 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 2 * 128 * 32 + 32


def test_a_chipset_train_config_is_a_planner_model_file(tmp_path):
    """Hugging Face key names are aliases; the [train] seq_len is the planned length."""
    from pathlib import Path

    from chipset.planner.model_file import load_model_toml

    root = Path(__file__).resolve().parents[2]
    m = load_model_toml(root / "examples" / "llama-1b.toml")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len) == (
        16, 2048, 32, 8, 8192, 128256, 4096)
    bad = tmp_path / "m.toml"
    bad.write_text("[model]\nhidden_size = 2048\nnum_attention_heads = 32\nhead_dim = 128\n")
    with pytest.raises(ConfigError, match="head_dim = 128 must equal hidden / heads"):
        load_model_toml(bad)
