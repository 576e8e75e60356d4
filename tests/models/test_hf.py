"""Hugging Face models in and out (docs/hf.md), with transformers as the reference.

Each supported family is built by transformers from a tiny random config, every weight
randomised (norm weights and biases too, so a mis-mapped norm or bias shows), and saved
with ``save_pretrained``. chipset loads the directory through ``model.init_from`` under
one process, tp2, pp2 and dp2 x ZeRO-3, and Qwen3 also under tp2 with sequence parallelism
and cp2 (each rank reading only its slices); the engine's
gathered parameters must equal the file's bit for bit, and chipset's logits must equal
transformers' own. Then ``chipset train`` fine-tunes a few steps (1 rank and tp2),
``chipset export`` writes HF and torch folders, and transformers reloads the export with no
missing or unexpected keys and the same logits as chipset from the same checkpoint.

This file is also its multi-rank jobs' script (tests/multirank.py).

Logit tolerance: max |chipset - transformers| / max |transformers| < 1e-5 in fp32. Both
compute the same operations in a possibly different order (fused vs split matmuls, rotary
tables in float64 vs float32); each logit is a chain of 2 blocks of dot products of at most
64 terms, whose rounding error is bounded by about n * eps = 64 * 1.2e-7 = 7.6e-6 relative
per reduction in the worst case and typically sqrt(n) * eps ~ 1e-6: 1e-5 is the issue's bound and
holds with a margin; a wrong mapping (tests below) moves logits by more than 1e-2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import forked_cli  # noqa: E402
import multirank  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3_tied": ("LlamaConfig", {"rope_parameters": LLAMA3, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "norm_topk_prob": True, "head_dim": 16}),
    # Block 0 dense (intermediate_size 64), block 1 MoE (experts 48 wide, shared expert 40), raw top-k gates.
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 40, "norm_topk_prob": False,
                                     "decoder_sparse_step": 2}),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
# Qwen2-MoE's MoE path is Mixtral's and Qwen3-MoE's under tp and pp (replicated experts, whole blocks per
# stage); its own parts (shared expert, mixed dense/MoE widths) are loaded under one process and dp2 x ZeRO-3
# x ep2, and trained under ep2, not under every layout again.
ONE_AND_EP_ONLY = ("qwen2_moe",)
# Big enough that a whole-file read stands out from allocator noise: ~17.8M params, 36 MB in bf16.
BIG = ("LlamaConfig", dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, intermediate_size=1536, max_position_embeddings=64))
LAYOUTS = {"one": (1, []), "tp2": (2, ["parallel.tp=2"]), "pp2": (2, ["parallel.pp=2"]),
           "zero3": (2, ["parallel.zero=3"]),
           "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]), "cp2": (2, ["parallel.cp=2"])}
SP_CP = ("tp2_sp", "cp2")
SP_CP_FAMILIES = ("qwen3",)  # one dense family: sp and cp shard activations, not weights differently
SEQ = 16
RTOL = 1e-5


# --------------------------------------------------------------------------------------
# Reference side (transformers, this process)
# --------------------------------------------------------------------------------------


def make_family(name: str, cls: str, extra: dict, root: Path, *, base=BASE, dtype=torch.float32) -> Path:
    """A transformers model of family ``cls`` with every weight random, saved under root/name."""
    import transformers

    cfg = getattr(transformers, cls)(**{**base, **extra})
    torch.manual_seed(sum(name.encode()))  # stable across processes
    model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(root / name)
    return root / name


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def chipset_logits(model_cfg: dict, params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Single-process chipset logits with ``params`` (full, logical tensors)."""
    import chipset
    from chipset.models import Transformer
    from chipset.models.config import ModelConfig

    cfg = ModelConfig(**model_cfg)
    model = Transformer(cfg, chipset.backend().kernels)
    sd = dict(params)
    if cfg.tie_word_embeddings:
        sd["head.lm_head.weight"] = sd["embed_tokens.weight"]
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    with torch.no_grad():
        return model.eval()(tokens)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def assert_params_equal_file(params: dict[str, torch.Tensor], path: Path, fam: str) -> None:
    """Every chipset parameter equals its HF tensor (stacked experts: the experts' tensors stacked)."""
    from chipset.models.hf.names import expert_names, to_hf

    want = file_tensors(path)
    seen = set()
    for n, t in params.items():
        experts = expert_names(n, fam, t.shape[0])
        ref = torch.stack([want[e] for e in experts]) if experts else want[to_hf(n, fam)]
        seen |= set(experts or [to_hf(n, fam)])
        assert torch.equal(t, ref), n
    assert seen == set(want)


# --------------------------------------------------------------------------------------
# The jobs (``python tests/models/test_hf.py MODE OUT`` or under torchrun)
# --------------------------------------------------------------------------------------


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _job(mode: str, out: str) -> None:
    from chipset.train import build
    from chipset.train.config import load_config
    from chipset.train.hf_weights import load_into_engine

    b = multirank.start()
    world = b.collective.world_size()
    root = Path(out).parent / "families"
    results: dict = {}
    for fam in SP_CP_FAMILIES if mode in SP_CP else FAMILIES:
        if mode in ("pp2", "zero3") and fam == "llama3_tied":
            continue  # tied embeddings are refused with pp > 1 and ZeRO-3 (test below)
        if mode in ("tp2", "pp2") and fam in ONE_AND_EP_ONLY:
            continue
        ep = ["parallel.ep=2"] if mode == "zero3" and fam in MOE else []  # experts sharded over the dp ranks
        cfg = load_config(None, [f"model.init_from={root / fam}", f"train.seq_len={SEQ}", *LAYOUTS[mode][1], *ep])
        cfg.validate(world_size=world)
        engine, _, _ = build(cfg, b)
        results[fam] = {k: v.detach().float().clone() for k, v in engine.full_parameters().items()}
    if mode in ("one", "zero3"):
        # Peak host memory of one more load of the bf16 model: VmHWM reset, load, VmHWM - RSS before.
        from chipset.models.registry import resolve_family
        from chipset.train.loop import build_model, make_dims

        cfg = load_config(None, [f"model.init_from={root / 'big'}", f"train.seq_len={SEQ}", *LAYOUTS[mode][1]])
        cfg.validate(world_size=world)
        try:
            # Building this rank's model for a file (before the engine wraps it): no parameter
            # memory, whatever the layout; a model built on the host would hold all of it here.
            Path("/proc/self/clear_refs").write_text("5")
            before = _vm("VmRSS")
            model = build_model(cfg, b, make_dims(cfg, world), resolve_family(cfg.model.family))
            built = _vm("VmHWM") - before
            del model
            engine, _, _ = build(cfg, b)
            Path("/proc/self/clear_refs").write_text("5")
            before = _vm("VmRSS")
            read = load_into_engine(engine, root / "big")
            peak = _vm("VmHWM")
            mem = {"delta": peak - before, "read": read, "build_model": built}
        except OSError:
            mem = None
        (Path(out).parent / f"mem-{mode}-rank{b.collective.rank()}.json").write_text(json.dumps(mem))
    multirank.finish(b, results, out)


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    root = tmp_path_factory.mktemp("hf") / "families"
    for name, (cls, extra) in FAMILIES.items():
        make_family(name, cls, extra, root)
    make_family("big", *BIG[:1], {}, root, base=BIG[1], dtype=torch.bfloat16)
    return root


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def loaded(families):
    multirank.require(2)
    jobs = [{"one": 1, "tp2": 2}, {"pp2": 2, "zero3": 2}]
    return multirank.run_jobs(HERE, jobs, families.parent, timeout=600)


@pytest.fixture(scope="module")
def loaded_sp_cp(families):
    multirank.require(2)
    return multirank.run_jobs(HERE, [{mode: 2 for mode in SP_CP}], families.parent, timeout=600)


def _model_cfg(fam_dir: Path) -> dict:
    import dataclasses

    from chipset.train.config import load_config

    return dataclasses.asdict(load_config(None, [f"model.init_from={fam_dir}"]).model)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_single_process_load_equals_transformers(families, loaded, tokens, fam):
    params = loaded["one"][fam]
    assert_params_equal_file(params, families / fam, fam)
    got = chipset_logits(_model_cfg(families / fam), params, tokens)
    ref = hf_logits(families / fam, tokens)
    print(f"logits {fam} one process: max rel diff {rel_diff(got, ref):.2e}")
    assert rel_diff(got, ref) < RTOL, (fam, rel_diff(got, ref))


@pytest.mark.multirank
@pytest.mark.parametrize("fam,layout", [(f, lay) for f in FAMILIES for lay in ("tp2", "pp2", "zero3")
                                        if f not in ONE_AND_EP_ONLY or lay == "zero3"])
def test_sharded_load_equals_the_file(families, loaded, tokens, fam, layout):
    """Each rank read only its slices; gathered, they are the file's tensors exactly."""
    if fam not in loaded[layout]:
        pytest.skip("tied embeddings are refused with pp > 1 and ZeRO-3")
    params = loaded[layout][fam]
    assert_params_equal_file(params, families / fam, fam)
    got = chipset_logits(_model_cfg(families / fam), params, tokens)
    d = rel_diff(got, hf_logits(families / fam, tokens))
    print(f"logits {fam} {layout}: max rel diff {d:.2e}")
    assert d < RTOL


@pytest.mark.multirank
@pytest.mark.parametrize("layout", SP_CP)
@pytest.mark.parametrize("fam", SP_CP_FAMILIES)
def test_sequence_and_context_parallel_load_equals_the_file(families, loaded_sp_cp, tokens, fam, layout):
    """tp2 with sequence parallelism and cp2: each rank read only its slices (tp) or the whole
    tensors it replicates (cp); gathered, they are the file's tensors exactly."""
    params = loaded_sp_cp[layout][fam]
    assert_params_equal_file(params, families / fam, fam)
    got = chipset_logits(_model_cfg(families / fam), params, tokens)
    d = rel_diff(got, hf_logits(families / fam, tokens))
    print(f"logits {fam} {layout}: max rel diff {d:.2e}")
    assert d < RTOL


def _rotary_interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The permutation between interleaved and half-split rotary rows (Meta <-> HF Llama layouts)."""
    d = w.shape[0] // heads
    return w.view(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("wrong", ["rotary_permutation", "swap_k_v", "qwen3_no_qk_norm", "mixtral_swap_w1_w3",
                                   "qwen2_moe_renormalised_gates", "qwen2_moe_shared_expert_swap_gate_up"])
def test_a_wrong_mapping_fails_the_comparison(families, loaded, tokens, wrong):
    fam = {"qwen3_no_qk_norm": "qwen3", "mixtral_swap_w1_w3": "mixtral"}.get(wrong, "llama")
    fam = "qwen2_moe" if wrong.startswith("qwen2_moe") else fam
    params = dict(loaded["one"][fam])
    cfg = _model_cfg(families / fam)
    if wrong == "rotary_permutation":
        for i in range(BASE["num_hidden_layers"]):
            for p, h in (("q_proj", 4), ("k_proj", 2)):
                k = f"layers.{i}.self_attn.{p}.weight"
                params[k] = _rotary_interleave(params[k], h)
    elif wrong == "swap_k_v":
        for i in range(BASE["num_hidden_layers"]):
            a, b = f"layers.{i}.self_attn.k_proj.weight", f"layers.{i}.self_attn.v_proj.weight"
            params[a], params[b] = params[b], params[a]
    elif wrong == "mixtral_swap_w1_w3":  # the experts' gate and up projections exchanged
        for i in range(BASE["num_hidden_layers"]):
            a, b = f"layers.{i}.mlp.experts.gate_proj", f"layers.{i}.mlp.experts.up_proj"
            params[a], params[b] = params[b], params[a]
    elif wrong == "qwen2_moe_renormalised_gates":  # norm_topk_prob = false in the file, ignored
        cfg["norm_topk_prob"] = True
    elif wrong == "qwen2_moe_shared_expert_swap_gate_up":  # only block 1 is MoE (decoder_sparse_step 2)
        a, b = "layers.1.mlp.shared_expert.gate_proj.weight", "layers.1.mlp.shared_expert.up_proj.weight"
        params[a], params[b] = params[b], params[a]
    else:
        cfg["qk_norm"] = False
        params = {k: v for k, v in params.items() if "q_norm" not in k and "k_norm" not in k}
    ref = hf_logits(families / fam, tokens)
    assert rel_diff(chipset_logits(_model_cfg(families / fam), loaded["one"][fam], tokens), ref) < RTOL
    print(f"logits {wrong}: max rel diff {rel_diff(chipset_logits(cfg, params, tokens), ref):.2e}")
    assert rel_diff(chipset_logits(cfg, params, tokens), ref) > 1e-2


@pytest.mark.multirank
def test_loading_holds_only_this_ranks_shard_in_host_memory(families, loaded):
    """Peak RSS added by a load (file pages touched + staging) is at most the rank's shard of the
    file plus one tensor, not the file: dp2 x ZeRO-3 ranks add about half of what one process adds;
    building the rank's model before the load adds no parameter memory (meta device)."""
    size = (families / "big" / "model.safetensors").stat().st_size
    largest = max(t.numel() * t.element_size() for t in file_tensors(families / "big").values())
    one = json.loads((families.parent / "mem-one-rank0.json").read_text())
    if one is None:
        pytest.skip("/proc/self/clear_refs cannot reset the peak RSS here")
    shard = [json.loads((families.parent / f"mem-zero3-rank{r}.json").read_text()) for r in range(2)]
    slack = 4 << 20  # allocator and page-granularity noise
    assert one["delta"] >= 0.9 * size  # the single process touches the whole file
    for m in shard:
        assert m["delta"] <= size / 2 + largest + slack, (m, size)  # its shard plus one tensor
    # The fp32 model is twice the bf16 file; built on the host it would add all of that before
    # the engine shards it. Built for a file it adds no parameter memory (rotary tables only).
    for m in (one, *shard):
        assert m["build_model"] <= slack, (m, size)
    print(f"big model file {size / 2**20:.1f} MiB (largest tensor {largest / 2**20:.1f} MiB): peak RSS added by "
          f"building the rank's model: 1 process {one['build_model'] / 2**20:.1f} MiB, dp2 ZeRO-3 ranks "
          + ", ".join(f"{m['build_model'] / 2**20:.1f}" for m in shard) + " MiB; by loading: 1 process "
          f"{one['delta'] / 2**20:.1f} MiB, dp2 ZeRO-3 ranks " + ", ".join(f"{m['delta'] / 2**20:.1f}" for m in shard)
          + " MiB")


# --- refusals ------------------------------------------------------------------------


def _chipset(*args, cwd=None, timeout=600):
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=multirank.env(), cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("patch,expect", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architectures = ['GPT2LMHeadModel']"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': unsupported; supported: \"silu\""),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_scaling.rope_type = 'yarn': unsupported; supported: default, llama3"),
    ({"num_local_experts": 8}, "num_local_experts = 8: unsupported key for LlamaForCausalLM"),
])
def test_unsupported_configs_are_refused_before_launch(families, tmp_path, patch, expect):
    hf = json.loads((families / "llama" / "config.json").read_text())
    hf.update(patch)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    r = _chipset("train", "--set", f"model.hf_config={tmp_path / 'config.json'}", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("patch,expect", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers = [1]: unsupported; supported: []"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True},
     "num_experts_per_tok = 1 with norm_topk_prob = true: unsupported; supported: >= 2, or >= 1 with norm_topk_prob"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0: expected an integer >= 1"),
])
def test_unsupported_qwen2_moe_keys_are_refused(families, tmp_path, patch, expect):
    """Qwen2-MoE keys chipset cannot express: exit 2 naming key, value and what is supported."""
    from chipset.errors import ConfigError
    from chipset.train.config import load_config

    hf = json.loads((families / "qwen2_moe" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **patch}))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.hf_config={tmp_path / 'config.json'}"])
    assert err.value.exit_code == 2
    assert expect in str(err.value), str(err.value)


def test_qwen2_moe_top1_without_renormalisation_is_accepted(families, tmp_path):
    """HF's top-1 gate with norm_topk_prob = false is the raw softmax score, as chipset's."""
    from chipset.train.config import load_config

    hf = json.loads((families / "qwen2_moe" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_experts_per_tok": 1}))
    m = load_config(None, [f"model.hf_config={tmp_path / 'config.json'}"]).model
    assert (m.num_experts_per_tok, m.norm_topk_prob, m.moe_every) == (1, False, 2)
    assert (m.intermediate_size, m.moe_intermediate_size, m.shared_expert_intermediate_size) == (64, 48, 40)


def test_a_key_the_model_directory_sets_is_not_silently_replaced(families):
    from chipset.errors import ConfigError
    from chipset.train.config import load_config

    with pytest.raises(ConfigError, match="model.num_hidden_layers = 1 conflicts with 2 from config.json"):
        load_config(None, [f"model.init_from={families / 'llama'}", "model.num_hidden_layers=1"])
    cfg = load_config(None, [f"model.init_from={families / 'llama'}", "model.num_hidden_layers=2"])
    assert cfg.model.num_key_value_heads == 2 and cfg.model.architecture == "LlamaForCausalLM"


def test_tied_embeddings_with_pp_and_a_bad_directory_are_refused(families, tmp_path):
    r = _chipset("train", "--set", f"model.init_from={families / 'llama3_tied'}", "--set", "parallel.pp=2",
                 "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "tie_word_embeddings = true with parallel.pp > 1" in r.stderr, r.stderr
    r = _chipset("train", "--set", f"model.init_from={tmp_path}")
    assert r.returncode == 2 and "expected a Hugging Face model directory" in r.stderr, r.stderr


def test_the_example_config_takes_a_model_directory(families):
    from chipset.errors import ConfigError
    from chipset.train.config import load_config

    example = HERE.parents[2] / "examples" / "hf-finetune.toml"
    with pytest.raises(ConfigError, match="model.init_from = 'path/to/your-hf-model': expected a Hugging Face"):
        load_config(example)
    cfg = load_config(example, [f"model.init_from={families / 'qwen2'}", "data.source=synthetic", "train.seq_len=32"])
    cfg.validate(world_size=2)
    assert cfg.model.architecture == "Qwen2ForCausalLM" and cfg.model.attention_bias and cfg.parallel.tp == 2


# --- train, export, reload -----------------------------------------------------------


@pytest.fixture(scope="module")
def trained(families, tmp_path_factory):
    """``chipset train`` 3 steps from each family (1 rank; tp2 for two of them), then both exports."""
    multirank.require(2)
    root = tmp_path_factory.mktemp("trained")
    # ep2: Qwen2-MoE (its shared expert is replicated over ep, its dense block is not sharded); Mixtral and
    # Qwen3-MoE run the same expert-parallel code and are loaded under ep2 in test_sharded_load_equals_the_file.
    runs = {fam: (fam, 1) for fam in FAMILIES} | {"qwen3_tp2": ("qwen3", 2), "llama3_tied_tp2": ("llama3_tied", 2),
                                                  "qwen2_moe_ep2": ("qwen2_moe", 2)}
    procs = {}
    for name, (fam, n) in runs.items():
        extra = ["--set", f"parallel.{name[-3:-1]}=2", "--nproc", "2"] if n == 2 else []
        procs[name] = forked_cli.popen(
            [*forked_cli.CLI, "train", "--set", f"model.init_from={families / fam}",
             "--set", "train.steps=3", "--set", "train.checkpoint_every=3", "--set", f"train.seq_len={SEQ}",
             "--set", "train.lr=0.01", *extra, "--run-dir", str(root / name)],
            env=multirank.env(), log=root / f"{name}.log")
    from chipset.cli.main import main

    for name, p in procs.items():
        p.wait(timeout=600)
        assert p.returncode == 0, (root / f"{name}.log").read_text()[-4000:]
        for fmt in ("hf", "torch"):
            # The CLI's own entry point, in this process: 22 interpreter starts saved; the tests below
            # run `chipset export` as a subprocess for its refusals and sharding.
            assert main(["export", str(root / name), "--format", fmt, "--out", str(root / f"{name}-{fmt}")]) == 0
    return root, runs


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(FAMILIES) + ["qwen3_tp2", "llama3_tied_tp2", "qwen2_moe_ep2"])
def test_trained_export_reloads_in_transformers_with_equal_logits(families, trained, tokens, name):
    root, runs = trained
    fam = runs[name][0]
    hf_dir, pt_dir = root / f"{name}-hf", root / f"{name}-torch"
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == \
        json.loads((families / fam / "config.json").read_text())["architectures"]
    params = torch.load(pt_dir / "model.pt", weights_only=True)
    start = file_tensors(families / fam)
    from chipset.models.hf.names import to_hf

    assert not torch.equal(params["layers.0.self_attn.q_proj.weight"], start[to_hf("layers.0.self_attn.q_proj.weight")])
    cfg = json.loads((pt_dir / "config.json").read_text())
    got = chipset_logits(cfg, params, tokens)
    ref = hf_logits(hf_dir, tokens)
    print(f"logits {name} trained + exported: max rel diff {rel_diff(got, ref):.2e}")
    assert rel_diff(got, ref) < RTOL


def test_a_run_from_scratch_exports_as_llama_and_a_top1_moe_is_refused(tmp_path, tokens):
    """chipset's default model is Llama under HF names; top-1 MoE routing has no HF family."""
    pytest.importorskip("transformers")
    for name, extra in (("dense", []), ("moe", ["--set", "model.num_experts=4"])):
        r = _chipset("train", "--set", "train.steps=2", "--set", "train.checkpoint_every=2", "--set",
                     f"train.seq_len={SEQ}", *extra, "--run-dir", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
    r = _chipset("export", str(tmp_path / "moe"), "--out", str(tmp_path / "moe-hf"))
    assert r.returncode == 2 and "num_experts_per_tok = 1" in r.stderr, r.stderr
    assert not (tmp_path / "moe-hf").exists()
    for fmt in ("hf", "torch"):
        r = _chipset("export", str(tmp_path / "dense"), "--format", fmt, "--out", str(tmp_path / f"dense-{fmt}"))
        assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "dense-hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    cfg = json.loads((tmp_path / "dense-torch" / "config.json").read_text())
    got = chipset_logits(cfg, torch.load(tmp_path / "dense-torch" / "model.pt", weights_only=True), tokens)
    assert rel_diff(got, hf_logits(tmp_path / "dense-hf", tokens)) < RTOL


def test_a_chipset_moe_with_a_shared_expert_exports_as_qwen2_moe():
    """From scratch, a MoE with a shared expert is Qwen2-MoE: the config.json it writes builds, in
    transformers, exactly the tensors (names and shapes) chipset's parameters map to."""
    transformers = pytest.importorskip("transformers")
    import chipset
    from chipset.models import Transformer
    from chipset.models.config import ModelConfig
    from chipset.models.hf.config import to_hf_config
    from chipset.models.hf.names import expert_names, to_hf

    m = ModelConfig(**BASE, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, moe_every=2,
                    moe_intermediate_size=48, shared_expert_intermediate_size=40)
    hf = to_hf_config(m)
    assert hf["architectures"] == ["Qwen2MoeForCausalLM"] and hf["qkv_bias"] is False
    with torch.device("meta"):
        ref = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**hf))
    want = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    mine = {}
    for n, t in Transformer(m, chipset.backend().kernels).named_parameters():
        experts = expert_names(n, "qwen2_moe", t.shape[0])
        mine.update({e: tuple(t.shape[1:]) for e in experts} if experts else {to_hf(n, "qwen2_moe"): tuple(t.shape)})
    # transformers keeps the experts fused in memory and splits them on save; compare the saved names.
    fused = {n for n in want if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for n in fused:
        e, w = want.pop(n), n.rsplit(".", 1)[1]
        for i in range(e[0]):
            if w == "down_proj":
                want[n.replace("experts.down_proj", f"experts.{i}.down_proj.weight")] = e[1:]
            else:
                for half in ("gate_proj", "up_proj"):
                    want[n.replace("experts.gate_up_proj", f"experts.{i}.{half}.weight")] = (e[1] // 2, e[2])
    assert mine == want


def test_export_refuses_a_non_empty_out_and_leaves_nothing_behind(trained):
    root, _ = trained
    out = root / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _chipset("export", str(root / "llama"), "--out", str(out))
    assert r.returncode == 2 and "never overwrites" in r.stderr, r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = _chipset("export", str(root / "llama"), "--step", "2", "--out", str(root / "nope"))
    assert r.returncode == 2 and "steps with checkpoints: 3" in r.stderr, r.stderr
    assert not (root / "nope").exists() and not list(root.glob(".nope.tmp-*"))


def test_export_shards_above_max_shard_size(trained):
    root, _ = trained
    from safetensors import safe_open

    out = root / "sharded"
    r = _chipset("export", str(root / "qwen2"), "--out", str(out), "--max-shard-mb", "0.02", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == files
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), "pt") as f:
            assert name in f.keys() and f.get_tensor(name).dtype == torch.bfloat16
    hf_logits(out, torch.zeros(1, 4, dtype=torch.long))  # loads with no missing or unexpected keys


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _job(sys.argv[1], sys.argv[2])
