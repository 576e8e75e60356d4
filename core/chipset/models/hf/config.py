"""Hugging Face ``config.json`` <-> :class:`chipset.train.config.ModelConfig`.

Only keys that change the network are mapped; every other key must be one this module
knows to be harmless (tokenizer ids, generation defaults, bookkeeping) or have the one
value chipset computes (``hidden_act = "silu"``, no dropout, ...). Anything else is
refused before launch with the key, the value and what is supported, so a model never
trains as something it is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chipset.models.config import ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "apply_hf_config", "from_hf_config", "to_hf_config", "model_problems",
           "weight_files"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
"""HF architecture -> model_type of the families chipset maps."""

MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
_MOE_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
             "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
_FAMILY_KEYS = {"qwen2_moe": ("shared_expert_intermediate_size", "qkv_bias")}
"""Keys one family maps on top of the MoE keys."""

_BY_TYPE = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}

# Keys with no effect on the network's function (tokenizer, generation, bookkeeping).
_IGNORED = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "finetuning_task", "task_specific_params",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "max_window_layers", "initializer_range", "auto_map", "output_router_logits",
}

# key -> the value chipset computes (anything else is refused).
_REQUIRED = {"hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.0,
             "use_sliding_window": False, "router_jitter_noise": 0.0}

_MAPPED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
           "rope_parameters", "head_dim", "tie_word_embeddings", "attention_bias", "sliding_window", "layer_types")


def _rope(hf: dict, out: dict, problems: list[str]) -> None:
    """``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        problems.append(f"rope_parameters / rope_scaling = {hf.get('rope_parameters')!r} / {scaling!r}: "
                        "expected a table or null")
        return
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out["rope_theta"] = float(theta)
    if kind == "default":
        out["rope_type"] = "default"
    elif kind == "llama3":
        out["rope_type"] = "llama3"
        for src, dst in (("factor", "rope_factor"), ("low_freq_factor", "rope_low_freq_factor"),
                         ("high_freq_factor", "rope_high_freq_factor"),
                         ("original_max_position_embeddings", "rope_original_max_position_embeddings")):
            if src not in params:
                problems.append(f"rope_scaling.{src}: missing; llama3 rope scaling needs factor, low_freq_factor, "
                                "high_freq_factor and original_max_position_embeddings")
            else:
                out[dst] = params[src] if dst.endswith("embeddings") else float(params[src])
    else:
        problems.append(f"rope_scaling.rope_type = {kind!r}: unsupported; supported: default, llama3")
    extra = set(params) - {"rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings", "partial_rotary_factor"}
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        extra.add("partial_rotary_factor")
    for k in sorted(extra):
        problems.append(f"rope_scaling.{k} = {params[k]!r}: unsupported; supported rope keys: rope_theta, rope_type "
                        "(default, llama3), factor, low_freq_factor, high_freq_factor, original_max_position_embeddings")


def from_hf_config(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(ModelConfig fields, problems)`` for an HF config dict; problems name key, value and what is supported."""
    problems: list[str] = []
    archs = hf.get("architectures") or ([_BY_TYPE[hf["model_type"]]] if hf.get("model_type") in _BY_TYPE else [])
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        found = archs or hf.get("model_type")
        return {}, [f"architectures = {found!r}: unsupported; supported: {supported}"]
    arch = archs[0]
    family = SUPPORTED_ARCHITECTURES[arch]
    if hf.get("model_type", family) != family:
        problems.append(f"model_type = {hf['model_type']!r}: expected {family!r} for {arch}")
    out: dict[str, Any] = {"architecture": arch}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        if not isinstance(hf.get(key), int):
            problems.append(f"{key} = {hf.get(key)!r}: expected an integer")
        else:
            out[key] = hf[key]
    out["num_key_value_heads"] = hf.get("num_key_value_heads") or hf.get("num_attention_heads", 0)
    out["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    if hf.get("head_dim") is not None:
        out["head_dim"] = int(hf["head_dim"])
    out["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if "initializer_range" in hf:
        out["init_std"] = float(hf["initializer_range"])
    _rope(hf, out, problems)
    bias = hf.get("attention_bias", False)
    if family == "qwen2":
        out["attention_bias"] = True  # Qwen2 always has q/k/v biases (no key)
        if "attention_bias" in hf:
            problems.append(f"attention_bias = {bias!r}: unsupported for Qwen2 (its q/k/v always have biases)")
    elif family == "qwen2_moe":
        out["attention_bias"] = bool(hf.get("qkv_bias", True))  # q/k/v only, as chipset's attention_bias
        if bias:
            problems.append(f"attention_bias = {bias!r}: unsupported for {arch}; its q/k/v biases are qkv_bias")
    elif bias:
        problems.append(f"attention_bias = {bias!r}: unsupported for {arch} (it biases the output projection too); "
                        "supported: false")
    out["qk_norm"] = family in ("qwen3", "qwen3_moe")
    if family in MOE_FAMILIES:
        _moe(hf, family, out, problems)
    window = hf.get("sliding_window")
    if family in ("mistral", "mixtral") and window is not None:
        out["sliding_window"] = int(window)  # train.seq_len <= window: the window never applies
    for i, kind in enumerate(hf.get("layer_types") or []):
        if kind != "full_attention":
            problems.append(f"layer_types[{i}] = {kind!r}: unsupported; supported: full_attention")
    for key, value in hf.items():
        if key in _MAPPED or key in _IGNORED or (family in MOE_FAMILIES and key in _MOE_KEYS) \
                or key in _FAMILY_KEYS.get(family, ()):
            continue
        if key in _REQUIRED:
            want = _REQUIRED[key]
            if value != want:
                problems.append(f"{key} = {value!r}: unsupported; supported: {json.dumps(want)}")
            continue
        problems.append(f"{key} = {_short(value)}: unsupported key for {arch}; chipset maps "
                        f"{', '.join(_MAPPED)} and ignores tokenizer/generation keys (docs/hf.md)")
    return out, problems


def _moe(hf: dict, family: str, out: dict, problems: list[str]) -> None:
    """Mixtral / Qwen3-MoE / Qwen2-MoE: softmax router over all experts, top-k.

    chipset's gates with ``num_experts_per_tok = 1`` are the raw softmax score, so top-1 is
    HF's only where HF does not renormalise (``norm_topk_prob = false``). Dense blocks keep
    ``intermediate_size``; experts use ``moe_intermediate_size``.
    """
    n = hf.get("num_local_experts", hf.get("num_experts"))
    k = hf.get("num_experts_per_tok", 2)
    norm = True if family == "mixtral" else hf.get("norm_topk_prob", False)
    step = 1 if family == "mixtral" else hf.get("decoder_sparse_step", 1)
    out.update(num_experts=n, num_experts_per_tok=k, router="softmax", capacity_factor=0.0, moe_every=step,
               norm_topk_prob=bool(norm), router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    if not isinstance(n, int) or n < 2:
        problems.append(f"num_local_experts / num_experts = {n!r}: expected an integer >= 2")
    if not isinstance(k, int) or k < 1 or (norm and k < 2):
        problems.append(f"num_experts_per_tok = {k!r} with norm_topk_prob = {json.dumps(bool(norm))}: unsupported; "
                        "supported: >= 2, or >= 1 with norm_topk_prob = false (chipset's top-1 gate is the raw "
                        "softmax score, a renormalised one would be 1)")
    if not isinstance(norm, bool):
        problems.append(f"norm_topk_prob = {norm!r}: expected true or false")
    if family == "mixtral":
        return
    if not isinstance(step, int) or step < 1:
        problems.append(f"decoder_sparse_step = {step!r}: expected an integer >= 1 (block i is MoE when "
                        "(i + 1) % decoder_sparse_step == 0)")
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers = {hf['mlp_only_layers']!r}: unsupported; supported: [] (which blocks "
                        "are MoE is set by decoder_sparse_step alone)")
    width = hf.get("moe_intermediate_size")
    if not isinstance(width, int) or width < 1:
        problems.append(f"moe_intermediate_size = {width!r}: expected a positive integer")
    else:
        out["moe_intermediate_size"] = width
    if family == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 0)
        if not isinstance(shared, int) or shared < 0:
            problems.append(f"shared_expert_intermediate_size = {shared!r}: expected an integer >= 0 (0: none)")
        else:
            out["shared_expert_intermediate_size"] = shared


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def weight_files(directory: Path) -> Path | None:
    """The index (sharded) or the single safetensors file of an HF model directory, or None."""
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if (directory / name).is_file():
            return directory / name
    return None


def apply_hf_config(m: ModelConfig) -> list[str]:
    """Fill ``m``'s architecture keys from ``m.init_from``/config.json or ``m.hf_config``; returns problems.

    Paths are made absolute, so ranks started elsewhere read the same files.
    """
    if m.init_from and m.hf_config:
        return [f"model.init_from = {m.init_from!r} and model.hf_config = {m.hf_config!r}: set one "
                "(init_from takes config.json from its directory)"]
    if m.init_from:
        d = Path(m.init_from).expanduser().absolute()
        key, path = "model.init_from", d / "config.json"
        if not d.is_dir() or not path.is_file() or weight_files(d) is None:
            return [f"model.init_from = {m.init_from!r}: expected a Hugging Face model directory with config.json "
                    "and model.safetensors (or model.safetensors.index.json and its shards)"]
        m.init_from = str(d)
    else:
        key, path = "model.hf_config", Path(m.hf_config).expanduser().absolute()
        m.hf_config = str(path)
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{key}: cannot read {path} as JSON ({exc}); expected a Hugging Face config.json"]
    fields, problems = from_hf_config(hf)
    default = ModelConfig()
    for name, value in fields.items():
        mine = getattr(m, name)
        if mine != getattr(default, name) and mine != value:  # set by the user: never silently replaced
            problems.append(f"model.{name} = {mine!r} conflicts with {value!r} from config.json; remove "
                            f"model.{name} (the model's own config.json sets it)")
        setattr(m, name, value)
    return [f"{key} ({path}): {p}" for p in problems]


def model_problems(m: ModelConfig, seq_len: int, pp: int, zero: int) -> list[str]:
    """Cross-field rules of the keys this module adds (called from :func:`chipset.train.config.validate`)."""
    problems = []
    if m.rope_type not in ("default", "llama3"):
        problems.append(f"model.rope_type = {m.rope_type!r}: expected default or llama3")
    elif m.rope_type == "llama3" and not (m.rope_high_freq_factor > m.rope_low_freq_factor > 0 and m.rope_factor > 0
                                          and m.rope_original_max_position_embeddings > 0):
        problems.append("model.rope_* (llama3): expected rope_high_freq_factor > rope_low_freq_factor > 0, "
                        "rope_factor > 0 and rope_original_max_position_embeddings > 0")
    if m.tie_word_embeddings and pp > 1:
        problems.append("model.tie_word_embeddings = true with parallel.pp > 1: the embedding and the logit layer "
                        "live on different stages; use pp = 1 (dp, tp and ZeRO 0-2 work)")
    if m.tie_word_embeddings and zero == 3:
        problems.append("model.tie_word_embeddings = true with parallel.zero = 3: the shared matrix would belong to "
                        "two gathered units; use zero <= 2")
    if m.sliding_window and seq_len > m.sliding_window:
        problems.append(f"train.seq_len ({seq_len}) > model.sliding_window ({m.sliding_window}): chipset attends "
                        "over the whole sequence; use train.seq_len <= sliding_window")
    if m.architecture and m.architecture not in SUPPORTED_ARCHITECTURES:
        problems.append(f"model.architecture = {m.architecture!r}: expected one of "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} (or empty)")
    family = SUPPORTED_ARCHITECTURES.get(m.architecture)
    if family in MOE_FAMILIES:
        reason = _hf_moe_problem(m, family)
        if reason:
            problems.append(f"model.architecture = {m.architecture!r}: {reason}")
    elif family and (m.shared_expert_intermediate_size or m.moe_intermediate_size):
        problems.append(f"model.architecture = {m.architecture!r} has no experts: model.moe_intermediate_size and "
                        "model.shared_expert_intermediate_size must be 0")
    return problems


def _hf_moe_problem(m: ModelConfig, family: str) -> str:
    """Why ``m`` is not a model of the HF MoE ``family`` ('' when it is)."""
    top1_ok = not m.norm_topk_prob
    if not (m.num_experts > 1 and m.router == "softmax" and (m.num_experts_per_tok >= 2 or top1_ok)):
        return (f"needs num_experts > 1, a softmax router and num_experts_per_tok >= 2 (or 1 with norm_topk_prob = "
                f"false); found num_experts = {m.num_experts}, router = {m.router!r}, num_experts_per_tok = "
                f"{m.num_experts_per_tok}, norm_topk_prob = {m.norm_topk_prob}")
    if family == "mixtral" and (m.moe_every != 1 or not m.norm_topk_prob or m.moe_intermediate_size
                                not in (0, m.intermediate_size)):
        return (f"Mixtral has every block MoE, renormalised gates and one MLP width; found moe_every = "
                f"{m.moe_every}, norm_topk_prob = {m.norm_topk_prob}, moe_intermediate_size = {m.moe_intermediate_size}")
    if family != "qwen2_moe" and m.shared_expert_intermediate_size:
        return (f"shared_expert_intermediate_size = {m.shared_expert_intermediate_size}: only Qwen2MoeForCausalLM "
                "has a shared expert")
    return ""


def _family_of(m: ModelConfig) -> tuple[str, str]:
    if m.architecture:
        return m.architecture, SUPPORTED_ARCHITECTURES[m.architecture]
    if m.num_experts > 1:
        arch = "Qwen3MoeForCausalLM" if m.qk_norm else "Qwen2MoeForCausalLM" if (
            m.shared_expert_intermediate_size or m.attention_bias) else "MixtralForCausalLM"
    else:
        arch = "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.attention_bias else "LlamaForCausalLM"
    return arch, SUPPORTED_ARCHITECTURES[arch]


def to_hf_config(m: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``m`` for transformers (raises ValueError for what HF cannot express)."""
    arch, family = _family_of(m)
    moe = family in MOE_FAMILIES
    reason = _hf_moe_problem(m, family) if moe else ""
    if moe != (m.num_experts > 1) or reason:
        raise ValueError(f"model.num_experts = {m.num_experts}, num_experts_per_tok = {m.num_experts_per_tok}, "
                         f"router = {m.router!r}, moe_every = {m.moe_every} as {arch}: "
                         f"{reason or 'dense families need num_experts 0, MoE families more than 1'}; "
                         "use --format torch")
    qwen2_bias = family in ("qwen2", "qwen2_moe") and m.attention_bias
    if m.qk_norm != (family in ("qwen3", "qwen3_moe")) or (m.attention_bias != (family == "qwen2") and not qwen2_bias):
        raise ValueError(f"model.architecture = {arch!r} with qk_norm = {m.qk_norm} and attention_bias = "
                         f"{m.attention_bias}: no Hugging Face family has this combination")
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    rope: dict[str, Any] = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if m.rope_type == "llama3":
        rope.update(factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_position_embeddings)
    out = {
        "architectures": [arch], "model_type": family,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads or m.num_attention_heads, "head_dim": hd,
        "hidden_act": "silu", "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.rms_norm_eps, "initializer_range": m.init_std,
        "tie_word_embeddings": m.tie_word_embeddings, "attention_dropout": 0.0,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta / rope_scaling.
        "rope_theta": m.rope_theta, "rope_scaling": None if m.rope_type == "default" else dict(rope),
        "rope_parameters": rope, "torch_dtype": "float32",
    }
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family in ("mistral", "mixtral"):
        out["sliding_window"] = m.sliding_window or None
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        if family in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = False
    if family == "mixtral":
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   router_jitter_noise=0.0, router_aux_loss_coef=m.router_aux_loss_coef, output_router_logits=False)
    elif family in ("qwen3_moe", "qwen2_moe"):
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   router_aux_loss_coef=m.router_aux_loss_coef,
                   moe_intermediate_size=m.moe_intermediate_size or m.intermediate_size,
                   decoder_sparse_step=m.moe_every, mlp_only_layers=[], norm_topk_prob=m.norm_topk_prob,
                   output_router_logits=False)
        if family == "qwen2_moe":
            out.update(qkv_bias=m.attention_bias, shared_expert_intermediate_size=m.shared_expert_intermediate_size)
    return out
