"""The planner's model spec: the reference decoder-only transformer family, dense and MoE.

Independent of the engine's run config on purpose (the planner must describe models far
larger than anything the engine runs here); :func:`from_engine_model_config` maps one onto
the other. Parameter counts are exact for the architecture described, so the presets
reproduce published sizes to the parameter (see tests/planner/test_planner_model.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from chipset.errors import ConfigError
from chipset.preflight import INT_LIMIT

__all__ = ["ModelSpec", "PRESETS", "get_preset", "apply_model_overrides", "from_engine_model_config"]

MLP_KINDS = ("swiglu", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "alibi")
KERNEL_KINDS = ("fused", "reference")


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer as the cost model sees it."""

    name: str = "custom"
    """A label for output."""
    layers: int = 2
    """Number of transformer blocks (l)."""
    hidden: int = 64
    """Width of the residual stream (h)."""
    heads: int = 4
    """Query heads (a); must divide hidden."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to heads."""
    ffn_hidden: int = 0
    """MLP intermediate width (f); 0 means 4*hidden for gelu, 8/3*hidden rounded up to 64 for swiglu."""
    vocab: int = 256
    """Vocabulary size (V), padded as the run pads it."""
    seq_len: int = 128
    """Training sequence length (s)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 or 1 means a dense model."""
    top_k: int = 1
    """Experts each token is routed to in a MoE layer."""
    moe_every: int = 1
    """Every n-th block is MoE (1: all of them); the others keep a dense MLP."""
    shared_ffn: int = 0
    """Width of a shared expert in every MoE block that every token passes through, scaled by a
    learned sigmoid gate (Qwen2-MoE); 0 = none. Placed like the experts over tp, never sharded by ep."""
    experts_split_over_tp: bool = True
    """Each tp rank holds 1/tp of every expert (Megatron-style); false: every tp rank holds whole
    experts (chipset's engine, docs/engine.md "MoE with tp, cp and pp")."""
    tied_embeddings: bool = False
    """The output projection reuses the input embedding matrix."""
    mlp: str = "swiglu"
    """"swiglu" (three matrices, the reference family) or "gelu" (two matrices, GPT-2/3)."""
    norm: str = "rmsnorm"
    """"rmsnorm" (weight only) or "layernorm" (weight and bias)."""
    bias: bool = False
    """Linear layers carry biases (GPT-3 style)."""
    position: str = "rope"
    """"rope" (no parameters; rotates q and k), "learned" (a seq_len x hidden table) or "alibi" (no
    parameters: a per-head linear bias added to the attention scores, BLOOM)."""
    dropout: bool = False
    """Dropout is applied (adds the masks Korthikanti et al. count to activation memory)."""
    flash_attention: bool = True
    """Attention never materialises the s x s score matrix (no 5as^2b activation term)."""
    kernels: str = "fused"
    """"fused" (norms, attention and cross-entropy as fused kernels: Korthikanti et al.'s count) or
    "reference": chipset's engine with its pure-torch reference kernels, as cpu_sim runs it
    (norms and attention keep float32 copies, the score matrix is materialised; see memory.py)."""

    # --- derived -----------------------------------------------------------------
    @property
    def kv(self) -> int:
        """Effective key/value heads."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads x head dim."""
        return self.kv * self.head_dim

    @property
    def ffn(self) -> int:
        """Effective MLP intermediate width."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.hidden
        return -(-(8 * self.hidden // 3) // 64) * 64

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def moe_layers(self) -> int:
        """Number of MoE blocks (every ``moe_every``-th block, counting from the first)."""
        return self.layers // self.moe_every if self.is_moe else 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    # --- parameters ---------------------------------------------------------------
    def mlp_params(self) -> int:
        """One dense MLP (one expert): weights and biases."""
        h, f = self.hidden, self.ffn
        if self.mlp == "swiglu":
            return 3 * h * f + (2 * f + h if self.bias else 0)
        return 2 * h * f + (f + h if self.bias else 0)

    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        return 2 * h * h + 2 * h * kv + ((h + 2 * kv + h) if self.bias else 0)

    def norm_params(self) -> int:
        """One normalisation layer."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def router_params(self) -> int:
        return self.hidden * self.num_experts if self.is_moe else 0

    def shared_expert_params(self) -> int:
        """The shared expert of one MoE block and its ``[1, hidden]`` gate; 0 without one."""
        if not (self.is_moe and self.shared_ffn):
            return 0
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * self.shared_ffn + self.hidden

    def layer_params(self, moe: bool) -> int:
        """All parameters of one block (MoE blocks hold every expert)."""
        mlp = (self.mlp_params() * self.num_experts + self.router_params() + self.shared_expert_params() if moe
               else self.mlp_params())
        return self.attention_params() + mlp + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Input embedding plus learned positions (if any)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.position == "learned" else 0)

    def output_params(self) -> int:
        """Final norm plus the output projection when it is not tied."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        """Total parameters, every expert counted."""
        return (
            self.dense_layers * self.layer_params(False)
            + self.moe_layers * self.layer_params(True)
            + self.embedding_params()
            + self.output_params()
        )

    def expert_params(self) -> int:
        """Parameters living in experts (sharded by ep); 0 for a dense model."""
        return self.moe_layers * self.mlp_params() * self.num_experts if self.is_moe else 0

    def active_params(self) -> int:
        """Parameters one token touches: top_k experts per MoE block instead of all of them."""
        if not self.is_moe:
            return self.num_params()
        return self.num_params() - self.moe_layers * self.mlp_params() * (self.num_experts - self.top_k)

    # --- validation ---------------------------------------------------------------
    def validate(self) -> ModelSpec:
        """Raise ConfigError naming every inconsistent field; return self when sound."""
        problems = []
        for f in ("layers", "hidden", "heads", "vocab", "seq_len", "top_k", "moe_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= INT_LIMIT:
                problems.append(f"model.{f} must be a positive integer of at most 2**63-1 (found {v!r})")
        for f in ("kv_heads", "ffn_hidden", "num_experts", "shared_ffn"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= INT_LIMIT:
                problems.append(f"model.{f} must be a non-negative integer of at most 2**63-1 (found {v!r})")
        for f, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("position", POSITION_KINDS),
                         ("kernels", KERNEL_KINDS)):
            if getattr(self, f) not in kinds:
                problems.append(f"model.{f} must be one of {', '.join(kinds)} (found {getattr(self, f)!r})")
        if not problems:
            if self.hidden % self.heads:
                problems.append(f"model.heads ({self.heads}) must divide model.hidden ({self.hidden})")
            if self.heads % self.kv:
                problems.append(f"model.kv_heads ({self.kv}) must divide model.heads ({self.heads})")
            if self.is_moe and self.top_k > self.num_experts:
                problems.append(f"model.top_k ({self.top_k}) must be <= model.num_experts ({self.num_experts})")
        if problems:
            raise ConfigError("invalid model spec: " + "; ".join(problems) + ". Fix the [model] table or the --set override.")
        return self


def _preset(**kw: Any) -> ModelSpec:
    return ModelSpec(**kw)


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # A model the CPU simulator can run; handy for tests and examples.
        _preset(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=176, vocab=256, seq_len=128),
        # GPT-3 175B (Brown et al. 2020, Table 2.1) as Megatron-LM runs it (Narayanan et al. 2021,
        # Sec. 5.1): V padded to 51,200, learned positions, LayerNorm, biases, tied embeddings.
        _preset(name="gpt3-175b", layers=96, hidden=12288, heads=96, ffn_hidden=4 * 12288, vocab=51200,
                seq_len=2048, mlp="gelu", norm="layernorm", bias=True, position="learned",
                tied_embeddings=True, dropout=True, flash_attention=False),
        # Llama 2 (Touvron et al. 2023, Table 1 and the released configs).
        _preset(name="llama2-7b", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096),
        _preset(name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000,
                seq_len=4096),
        # Llama 3 (Dubey et al. 2024, Table 3 and the released configs).
        _preset(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                seq_len=8192),
        _preset(name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                vocab=128256, seq_len=8192),
        # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2 routing in every block.
        _preset(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                seq_len=4096, num_experts=8, top_k=2),
    )
}


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name``; ConfigError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def _field_types() -> dict[str, type]:
    return {f.name: type(getattr(ModelSpec(), f.name)) for f in fields(ModelSpec)}


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif typ is str:
        return str(value)
    raise ConfigError(f"model.{key}: expected {typ.__name__}, found {value!r}")


HF_ALIASES = {
    "hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads", "intermediate_size": "ffn_hidden", "vocab_size": "vocab",
    "max_position_embeddings": "seq_len", "tie_word_embeddings": "tied_embeddings",
    "num_experts_per_tok": "top_k", "shared_expert_intermediate_size": "shared_ffn",
}
"""Hugging Face / ``chipset train`` key names accepted for the planner's own."""
HF_IGNORED = frozenset({"rope_theta", "rms_norm_eps", "norm_eps", "initializer_range", "rope_scaling"})
"""Keys of a ``chipset train`` [model] table that do not change the cost model."""


def _unalias(values: dict[str, Any], origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    head_dim = values.get("head_dim")
    for k, v in values.items():
        if k in HF_IGNORED or k == "head_dim":
            continue
        key = HF_ALIASES.get(k, k)
        if key in out and k != key:
            raise ConfigError(f"{origin}: both {k!r} and {key!r} given; keep one")
        out[key] = v
    if head_dim is not None:
        hidden, heads = out.get("hidden"), out.get("heads")
        if not hidden or not heads or int(head_dim) * int(heads) != int(hidden):
            raise ConfigError(f"{origin}: head_dim = {head_dim} must equal hidden / heads "
                              f"(found hidden {hidden}, heads {heads}); the planner models head_dim = hidden / heads")
    return out


def _update(spec: ModelSpec, values: dict[str, Any], origin: str) -> ModelSpec:
    types = _field_types()
    values = _unalias(values, origin)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(
            f"{origin}: unknown model key(s) {', '.join(unknown)}; valid keys: {', '.join(types)}"
        )
    return dataclasses.replace(spec, **{k: _coerce(k, v, types[k]) for k, v in values.items()})


def apply_model_overrides(spec: ModelSpec, overrides: list[str]) -> ModelSpec:
    """Apply ``model.key=value`` strings (the ``--set`` syntax)."""
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model.") or not key[6:]:
            raise ConfigError(f"--set {item!r}: expected model.KEY=VALUE (for example model.layers=48)")
        values[key[6:]] = value
    return _update(spec, values, "--set")


def from_engine_model_config(cfg: Any, seq_len: int, name: str = "engine") -> ModelSpec:
    """Map the engine's model config (Hugging Face key names) onto a ModelSpec.

    Field mapping: vocab_size -> vocab, hidden_size -> hidden, num_hidden_layers -> layers,
    num_attention_heads -> heads, num_key_value_heads -> kv_heads (0: same as heads),
    intermediate_size -> ffn_hidden (moe_intermediate_size when every block is MoE); tie_word_embeddings -> tied_embeddings and
    num_experts / num_experts_per_tok (engine and Hugging Face; top_k in configs before 0.2) / moe_every
    when present. The engine's model is the
    reference family (SwiGLU, RMSNorm, RoPE, no biases, no dropout), so those fields keep
    their defaults. Read by attribute, so the planner never imports the engine's config.
    """
    g = lambda k, d=0: getattr(cfg, k, d)  # noqa: E731
    ffn = g("intermediate_size")
    if (g("num_experts") or 0) > 1 and (g("moe_every", 1) or 1) == 1 and g("moe_intermediate_size"):
        ffn = g("moe_intermediate_size")  # every block MoE: the dense width is never built
    return ModelSpec(
        name=name, layers=g("num_hidden_layers"), hidden=g("hidden_size"), heads=g("num_attention_heads"),
        kv_heads=g("num_key_value_heads") or 0, ffn_hidden=ffn, vocab=g("vocab_size"),
        seq_len=seq_len, num_experts=g("num_experts") or 0, top_k=g("num_experts_per_tok", 0) or g("top_k", 1) or 1,
        moe_every=g("moe_every", 1) or 1, shared_ffn=g("shared_expert_intermediate_size", 0) or 0,
        tied_embeddings=bool(g("tie_word_embeddings", False)),
    ).validate()
