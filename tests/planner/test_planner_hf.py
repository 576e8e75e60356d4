"""``chipset plan --model`` with a Hugging Face config.json or model directory (docs/planner.md).

The planner translates the config with the code ``chipset train`` uses, so its parameter
count must equal the parameters transformers builds from the same config.json, exactly,
less precisely the parts it says (on stderr) that it leaves out.
"""

from __future__ import annotations

import json

import pytest
import torch

from chipset.cli.main import main
from chipset.interfaces.device import DeviceProperties

transformers = pytest.importorskip("transformers")

DEV = DeviceProperties(name="plan-test", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 300e12},
                       memory_bandwidth=2e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)
TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _profiles(monkeypatch):
    """A known profile whatever the installed plugins declare."""
    import chipset.planner.cluster as cluster

    monkeypatch.setattr(cluster, "all_profiles", lambda: {"plan-test": ("testbackend", DEV)})


def _save(tmp_path, cls, **extra):
    cfg = getattr(transformers, cls)(**{**TINY, **extra})
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):  # shapes only
        model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(cfg)
    return tmp_path, dict(model.named_parameters())


def _plan(capsys, *args):
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("as_dir", [True, False])
def test_a_llama_config_plans_the_model_transformers_builds(tmp_path, capsys, as_dir):
    from chipset.planner.hf import load_hf_config

    path, params = _save(tmp_path, "LlamaConfig")
    spec, notes = load_hf_config(path if as_dir else path / "config.json")
    assert notes == []
    assert spec.num_params() == sum(p.numel() for p in params.values())
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.seq_len) == (2, 32, 4, 2, 64)
    rc, out, err = _plan(capsys, "--model", str(path if as_dir else path / "config.json"), "--cluster",
                         "1x2:plan-test", "--global-batch", "4", "--set", "model.num_hidden_layers=4", "--json")
    assert rc == 0, err
    assert json.loads(out) and err == ""


def test_qwen2_moe_counts_all_but_what_the_notes_name(tmp_path, capsys):
    """The shared expert is counted; q/k/v biases are the only parameters left out, and it says so."""
    from chipset.planner.hf import load_hf_config

    path, params = _save(tmp_path, "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                         shared_expert_intermediate_size=40)
    spec, notes = load_hf_config(path)
    left_out = sum(p.numel() for n, p in params.items() if n.endswith(".bias"))
    assert spec.num_params() == sum(p.numel() for p in params.values()) - left_out
    assert (spec.num_experts, spec.top_k, spec.ffn, spec.shared_ffn) == (4, 2, 48, 40)  # all MoE: experts' width
    assert len(notes) == 1 and "q/k/v biases" in notes[0]
    rc, _, err = _plan(capsys, "--model", str(path), "--cluster", "1x2:plan-test", "--global-batch", "4", "--json")
    assert rc == 0 and "WARNING" in err and "q/k/v biases are not counted" in err, err


def test_the_shared_expert_costs_parameters_and_flops():
    """A shared expert adds its parameters (active too) and 6*h*f + 2*h forward FLOPs per token per MoE block."""
    from dataclasses import replace

    from chipset.planner.flops import forward_flops_per_token as per_token
    from chipset.planner.model import ModelSpec

    base = ModelSpec(layers=4, hidden=64, heads=4, ffn_hidden=32, num_experts=4, top_k=2, moe_every=2)
    shared = replace(base, shared_ffn=48)
    assert shared.num_params() - base.num_params() == 2 * (3 * 64 * 48 + 64)
    assert per_token(shared).mlp - per_token(base).mlp == 2 * (6 * 64 * 48 + 2 * 64)
    assert shared.active_params() - base.active_params() == 2 * (3 * 64 * 48 + 64)


def test_a_train_config_with_init_from_plans_the_directory_at_its_seq_len(tmp_path, capsys):
    """``chipset plan --model`` on a fine-tuning config (examples/hf-finetune.toml's shape)."""
    from chipset.planner.hf import load_hf_config
    from chipset.planner.model_file import load_model_toml

    path, _ = _save(tmp_path / "m", "Qwen2Config")
    toml = tmp_path / "ft.toml"
    toml.write_text(f'[model]\ninit_from = "{path}"\n\n[train]\nseq_len = 32\n')
    spec = load_model_toml(toml)
    assert spec.seq_len == 32 and spec.num_params() == load_hf_config(path)[0].num_params()
    rc, out, err = _plan(capsys, "--model", str(toml), "--cluster", "1x2:plan-test", "--global-batch", "4", "--json")
    assert rc == 0 and json.loads(out), err


@pytest.mark.parametrize("patch,expect", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architectures = ['GPT2LMHeadModel']: unsupported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': unsupported"),
])
def test_an_architecture_training_refuses_is_refused_with_exit_2(tmp_path, capsys, patch, expect):
    path, _ = _save(tmp_path, "LlamaConfig")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, **patch}))
    rc, out, err = _plan(capsys, "--model", str(path / "config.json"), "--cluster", "1x2:plan-test")
    assert rc == 2 and expect in err and out == "", err


def test_a_file_that_is_not_json_is_refused_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    rc, _, err = _plan(capsys, "--model", str(bad), "--cluster", "1x2:plan-test")
    assert rc == 2 and "expected a Hugging Face config.json" in err, err
