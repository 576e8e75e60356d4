"""A reference decoder-only transformer (Llama-style): RMSNorm, rotary, SwiGLU, causal attention.

Every numerical primitive goes through the backend's kernel registry
(``kernels.rms_norm``, ``kernels.rotary_embedding``, ``kernels.swiglu``,
``kernels.scaled_dot_product_attention``, ``kernels.cross_entropy``), so a backend's
fused kernels are used where it registers them and the core references elsewhere.

Recompute is data on the model: ``block.recompute`` is ``"none"``, ``"selective"``
(the attention core is recomputed in backward) or ``"full"`` (the whole block is).
The engine sets it (:func:`chipset.engine.recompute.apply_recompute`).

Parallelism is data on the model too, swapped in by the engine's ``apply_*`` functions
(the model never imports torch.distributed): ``Attention.attend`` (the attention core
over ``(q, k, v)``; None = the kernel's causal attention), ``Transformer.loss_fn`` (None
= the cross-entropy kernel), ``Transformer.seq_layout`` (None = every rank sees whole
sequences; else an object with ``local(t)`` selecting this rank's tokens along dim 1 and
``positions(s, device)`` giving their positions), and the projection, embedding and norm
submodules themselves (replaced by tensor-parallel layers of the same parameter names).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chipset.config import ModelConfig
from chipset.kernels import KernelRegistry
from chipset.models.moe import MoE, is_moe_layer

__all__ = ["Transformer", "Block", "OutputHead", "head_dim", "rope_inv_freq"]


def head_dim(cfg: ModelConfig) -> int:
    """Width of one attention head: ``cfg.head_dim``, or hidden_size / heads when 0."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (float64, ``[head_dim / 2]``), with ``cfg.rope_type`` scaling.

    ``llama3`` (Llama 3.1): wavelengths longer than ``original / low_freq_factor`` are
    divided by ``factor``, shorter than ``original / high_freq_factor`` kept, and those
    between interpolated linearly in ``original / wavelength``.
    """
    d = head_dim(cfg)
    # On the host explicitly: a model built on the meta device still needs real rotary tables.
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if cfg.rope_type != "llama3":
        return inv
    orig = cfg.rope_original_max_position_embeddings
    lo, hi, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelen = 2 * torch.pi / inv
    smooth = ((orig / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelRegistry):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._k = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = head_dim(cfg)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if cfg.qk_norm:  # per-head RMSNorm of q and k before rotary (Qwen3)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self._k = kernels
        self.recompute_core = False
        self.attend = None  # pluggable attention core (context parallel); None = causal kernel

    def _core(self, q, k, v, cos, sin):
        q = self._k.rotary_embedding(q, cos, sin)
        k = self._k.rotary_embedding(k, cos, sin)
        if self.attend is not None:
            return self.attend(q, k, v)
        return self._k.scaled_dot_product_attention(q, k, v, causal=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)
        # Shapes from the projection: a sequence-parallel projection gathers the sequence.
        # Head counts from the widths: a tensor-parallel rank holds whole heads of q, k and v.
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recompute: keep the projections, drop the s x s attention scores.
            out = checkpoint(self._core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self._core(q, k, v, cos, sin)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self._k = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._k.swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry, *, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MoE(cfg, kernels) if moe else MLP(cfg, kernels)  # MoE: models/moe.py

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class OutputHead(nn.Module):
    """Final norm and the logit projection."""

    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens) -> logits``; ``loss(tokens, targets)``."""

    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry, *, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self._k = kernels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, kernels, moe=is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)
        )
        self.head = OutputHead(cfg, kernels)
        if cfg.tie_word_embeddings:  # one Parameter, named embed_tokens.weight
            self.head.lm_head.weight = self.embed_tokens.weight
        self.recompute = "none"
        self.loss_fn = None  # pluggable (vocab-parallel cross-entropy); None = the kernel
        self.seq_layout = None  # pluggable (context parallel): which tokens this rank holds
        inv = rope_inv_freq(cfg)
        ang = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64, device="cpu"), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("rope_cos", ang.cos().float(), persistent=False)
        self.register_buffer("rope_sin", ang.sin().float(), persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed`` (independent of the global RNG), in name order.
        Parameters on the meta device (built to be filled from a file) are left as they are."""
        g = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * self.cfg.init_std)

    def units(self) -> list[nn.Module]:
        """The modules whose parameters are gathered together under ZeRO-3, in forward order."""
        return [self.embed_tokens, *self.layers, self.head]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens`` at ``positions`` (default ``0..s-1``)."""
        s = tokens.shape[1]
        cos = self.rope_cos[:s] if positions is None else self.rope_cos[positions]
        sin = self.rope_sin[:s] if positions is None else self.rope_sin[positions]
        cos = cos.to(self.embed_tokens.weight.dtype)
        sin = sin.to(self.embed_tokens.weight.dtype)
        x = self.embed_tokens(tokens)
        for block in self.layers:
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head(x)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, aux: bool = True) -> torch.Tensor:
        """Mean next-token cross-entropy (float32) over the tokens this rank holds.

        ``aux``: add a MoE model's load-balancing loss (training); evaluation leaves it out.
        """
        positions = None
        if self.seq_layout is not None:
            positions = self.seq_layout.positions(tokens.shape[1], tokens.device)
            tokens, targets = self.seq_layout.local(tokens), self.seq_layout.local(targets)
        logits = self(tokens, positions)
        loss_fn = self.loss_fn or self._k.cross_entropy
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        moe = [m for m in self.modules() if isinstance(m, MoE)]
        if aux and moe and self.cfg.router_aux_loss_coef:  # MoE load-balancing loss (models/moe.py)
            loss = loss + self.cfg.router_aux_loss_coef * torch.stack([m.aux_loss for m in moe]).sum()
        return loss
