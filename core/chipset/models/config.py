"""The ``[model]`` table: the keys of the built-in decoder-only transformer, plus the keys a
family declares for itself.

A family with keys of its own (``ModelFamily.config_class``, a dataclass: resnet's
``num_classes``, a user family's widths) gets them in the same ``[model]`` table; they are
validated against that dataclass when the config is read and kept in
:attr:`ModelConfig.family_options`, and the family reads them typed with
``family.options(cfg)``. Kept in ``models/`` so that model code, the layers it is built from and
the planner read it without importing the training room.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ROUTERS", "ModelConfig", "is_family_keys"]

ROUTERS = ("softmax", "sigmoid")


@dataclass
class ModelConfig:
    """The decoder-only transformer. Keys are named as in Hugging Face model configs."""

    family: str = "transformer"
    """Model family (docs/models.md): transformer (built in), a name from ``chipset models``, or
    package.module:factory for a model in your own code."""
    vocab_size: int = 128
    """Number of token ids (embedding rows and logits)."""
    hidden_size: int = 32
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads per attention layer; must divide hidden_size."""
    num_key_value_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means equal to num_attention_heads."""
    intermediate_size: int = 64
    """Hidden width of the SwiGLU MLP."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary tables are built for; must be >= train.seq_len."""
    rms_norm_eps: float = 1e-6
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    num_experts: int = 0
    """Experts per MoE layer; 0 or 1 means a dense model (planner spec name)."""
    num_experts_per_tok: int = 1
    """Experts each token is routed to in a MoE layer."""
    moe_every: int = 1
    """Every n-th block is MoE (block i, 0-based, when (i+1) % moe_every == 0); the others keep the dense MLP."""
    router: str = "softmax"
    """MoE gating: softmax (over all experts) or sigmoid (per expert); top-k gates renormalised when num_experts_per_tok > 1."""
    capacity_factor: float = 0.0
    """Expert capacity per sequence = ceil(capacity_factor * seq_len * num_experts_per_tok / num_experts); 0 = no dropping."""
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformers' alpha), added to the loss per MoE layer."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gates to sum to 1 (num_experts_per_tok > 1); false keeps the raw router scores (Qwen2-MoE)."""
    moe_intermediate_size: int = 0
    """Width of each expert's MLP; 0 means intermediate_size (dense blocks always use intermediate_size)."""
    shared_expert_intermediate_size: int = 0
    """Width of a shared expert every token passes through, scaled by a sigmoid gate (Qwen2-MoE); 0 = none."""
    head_dim: int = 0
    """Width of one attention head; 0 means hidden_size / num_attention_heads."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2); the output projection never has one."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before rotary (Qwen3)."""
    tie_word_embeddings: bool = False
    """The logit layer shares the embedding matrix (not with parallel.pp > 1 or parallel.zero = 3)."""
    rope_type: str = "default"
    """Rotary frequencies: default, or llama3 (Llama 3.1 scaling with the rope_* keys below)."""
    rope_factor: float = 8.0
    """llama3 rotary scaling: factor by which low frequencies are divided."""
    rope_low_freq_factor: float = 1.0
    """llama3 rotary scaling: wavelengths above original_max / low_freq_factor are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 rotary scaling: wavelengths below original_max / high_freq_factor are kept."""
    rope_original_max_position_embeddings: int = 8192
    """llama3 rotary scaling: the context length the model was pre-trained with."""
    sliding_window: int = 0
    """Attention window of the source model (Mistral); train.seq_len must not exceed it. 0 = none."""
    architecture: str = ""
    """Hugging Face architecture written on export (e.g. Qwen2ForCausalLM); empty = LlamaForCausalLM."""
    hf_config: str = ""
    """A Hugging Face config.json: the architecture keys above are taken from it (random init), docs/hf.md."""
    init_from: str = ""
    """A Hugging Face model directory (config.json + safetensors): architecture and weights, docs/hf.md."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the layers model.lora_targets names, the rest of the model frozen; 0 = off (docs/hf.md)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: each adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input while training (0 <= p < 1); its masks are not the same across layouts."""
    lora_targets: str = ""
    """Layers LoRA adapts: comma-separated module-name patterns in the tp plans' vocabulary (e.g. "layers.*.self_attn.q_proj, layers.*.self_attn.v_proj"); empty = every projection the family's tp plan splits (attention and MLP)."""
    family_options: dict[str, Any] = field(default_factory=dict, metadata={"family_keys": True})
    """Not a key of its own: the ``[model]`` keys the family declares in its ``config_class``,
    validated when the config is read; written back into ``[model]`` with the others."""


def is_family_keys(f) -> bool:
    """Whether dataclass field ``f`` holds a family's own keys (not a key of the table itself)."""
    return bool(f.metadata.get("family_keys"))
