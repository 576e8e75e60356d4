"""A reference decoder-only transformer (Llama-style): RMSNorm, rotary, SwiGLU, causal attention.

Every numerical primitive goes through the backend's kernel registry
(``kernels.rms_norm``, ``kernels.rotary_embedding``, ``kernels.swiglu``,
``kernels.scaled_dot_product_attention``, ``kernels.cross_entropy``), so a backend's
fused kernels are used where it registers them and the core references elsewhere.

Recompute is set by the family (:meth:`chipset.models.family.TransformerFamily.apply_recompute`):
``Attention.recompute_core`` recomputes the attention core in backward (``"selective"``);
``"full"`` runs each block under activation checkpointing.

Rotary tables live in one :class:`Rotary` shared by every attention module: a block called
alone (a pipeline stage runs blocks one by one) finds its own cosines and sines, at the
positions ``seq_layout`` gives its tokens.

Parallelism is data on the model too, swapped in by the engine's ``apply_*`` functions
(the model never imports torch.distributed): ``Attention.attend`` (the attention core
over ``(q, k, v)``; None = the kernel's causal attention), the logit layer's ``vocab_loss``
(set by a tensor-parallel vocab head; absent = the cross-entropy kernel), ``Transformer.seq_layout`` (None = every rank sees whole
sequences; else an object with ``local(t)`` selecting this rank's tokens along dim 1,
``positions(s, device)`` giving their positions and ``size``, the number of shares), and
the projection, embedding and norm submodules themselves (replaced by tensor-parallel
layers of the same parameter names).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chipset.kernels import KernelRegistry
from chipset.kernels.blockwise import BlockAttention
from chipset.layers.documents import document_ids, document_positions
from chipset.layers.moe import MoE, is_moe_layer
from chipset.models.config import ModelConfig

__all__ = ["Transformer", "Block", "OutputHead", "Rotary", "head_dim", "rope_inv_freq"]


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


class Rotary:
    """Rotary cosines and sines for every position up to ``max_position_embeddings``.

    The tables are computed once, on first use, in float64 and kept in float32 on the host;
    what a forward reads is cached per (length, device, dtype), so no step rebuilds or casts
    them. Not a module: nothing of it is saved, moved or cast with the parameters.
    """

    def __init__(self, cfg: ModelConfig):
        self._cfg = cfg
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # built on first use
        self.layout = None  # the model's seq_layout (context parallel): which positions this rank holds
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.documents = None  # document masks: (b, s) document ids of the whole sequences of the last forward

    @property
    def cos(self) -> torch.Tensor:
        return self._build()[0]

    @property
    def sin(self) -> torch.Tensor:
        return self._build()[1]

    def _build(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            ang = torch.outer(torch.arange(self._cfg.max_position_embeddings, dtype=torch.float64, device="cpu"),
                              rope_inv_freq(self._cfg))
            ang = torch.cat((ang, ang), dim=-1)
            self._tables = (ang.cos().float(), ang.sin().float())
        return self._tables

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at ``positions`` (not cached), in ``dtype`` on their device: ``[s, head_dim]``
        for positions ``[s]``, ``[b, 1, s, head_dim]`` for per-sequence positions ``[b, s]``."""
        pos = positions.to("cpu")
        cos, sin = self.cos[pos].to(positions.device, dtype), self.sin[pos].to(positions.device, dtype)
        return (cos.unsqueeze(1), sin.unsqueeze(1)) if pos.dim() == 2 else (cos, sin)

    def tables(self, s: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[s, head_dim]`` for the ``s`` tokens this rank holds of each
        sequence: positions ``0..s-1``, or with a ``layout`` its share of a sequence of
        ``s * layout.size`` tokens."""
        layout = self.layout
        key = (s, str(device), dtype, id(layout))
        hit = self._cache.get(key)
        if hit is None:
            with torch.inference_mode(False), torch.no_grad():
                if layout is None:
                    hit = (self.cos[:s].to(device, dtype), self.sin[:s].to(device, dtype))
                else:
                    pos = layout.positions(s * layout.size, "cpu")
                    hit = (self.cos[pos].to(device, dtype), self.sin[pos].to(device, dtype))
            self._cache[key] = hit
        return hit


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelRegistry):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._k = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry, rotary: Rotary | None = None):
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
        self.rotary = rotary if rotary is not None else Rotary(cfg)
        self.recompute_core = False
        self.attend = None  # pluggable attention core (context parallel); None = causal kernel

    def _core(self, q, k, v, cos, sin):
        q = self._k.rotary_embedding(q, cos, sin)
        k = self._k.rotary_embedding(k, cos, sin)
        docs = self.rotary.documents
        if self.attend is not None:
            return self.attend(q, k, v) if docs is None else self.attend(q, k, v, docs)
        if docs is None:
            return self._k.scaled_dot_product_attention(q, k, v, causal=True)
        rep = q.shape[1] // k.shape[1]  # the block kernels take as many kv heads as query heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return BlockAttention.apply(q, k, v, self._k, (docs, docs), True)  # masked tile by tile

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``cos``/``sin``: the rotary tables of ``x``'s positions (None: from :attr:`rotary`)."""
        q = self.q_proj(x)
        # Shapes from the projection: a sequence-parallel projection gathers the sequence.
        # Head counts from the widths: a tensor-parallel rank holds whole heads of q, k and v.
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos is None:
            cos, sin = self.rotary.tables(s, q.device, q.dtype)
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

    def __init__(self, cfg: ModelConfig, kernels: KernelRegistry, *, moe: bool = False, rotary: Rotary | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, kernels, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MoE(cfg, kernels) if moe else MLP(cfg, kernels)  # MoE: layers/moe.py

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                ) -> torch.Tensor:
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
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(
            Block(cfg, kernels, moe=is_moe_layer(cfg, i), rotary=self.rotary) for i in range(cfg.num_hidden_layers)
        )
        for i, block in enumerate(self.layers):
            if isinstance(block.mlp, MoE):
                block.mlp.layer = i
        self.head = OutputHead(cfg, kernels)
        if cfg.tie_word_embeddings:  # one Parameter, named embed_tokens.weight
            self.head.lm_head.weight = self.embed_tokens.weight
        self.seq_layout = None  # pluggable (context parallel): which tokens this rank holds
        self.document_eos = None  # data.document_mask: the id that ends a document (None: off)
        self.loss_chunk = 0  # train.loss_chunk: tokens per chunk of the head and loss (0: all at once)
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

    @property
    def seq_layout(self):
        """Which tokens of each sequence this rank holds (None: all); the rotary tables follow it."""
        return self.rotary.layout

    @seq_layout.setter
    def seq_layout(self, layout) -> None:
        self.rotary.layout = layout

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens`` at ``positions`` (default: ``0..s-1``, or this rank's share of
        them under ``seq_layout``); ``documents``: document ids of the whole sequences (b, s)
        for document masks (None: causal attention over everything)."""
        return self.head(self.hidden(tokens, positions, documents))

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               documents: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's output (before the head) of :meth:`forward`."""
        # Kept until the next forward: a recomputed block reads them again in backward.
        self.rotary.documents = documents
        dtype = self.embed_tokens.weight.dtype
        if positions is None:
            cos, sin = self.rotary.tables(tokens.shape[1], tokens.device, dtype)
        else:
            cos, sin = self.rotary.at(positions, dtype)
        x = self.embed_tokens(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        return x

    def output_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``logits``: the vocabulary-parallel one the split head
        holds when tensor parallelism split them (its ``vocab_loss``), else the backend's
        cross-entropy kernel."""
        loss_fn = getattr(self.head.lm_head, "vocab_loss", None) or self._k.cross_entropy
        return loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def chunked_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`output_loss` of ``head(x)``, ``loss_chunk`` tokens at a time: each chunk's
        logits are dropped after its loss and recomputed in backward, so at most one chunk's
        ``[tokens x vocab]`` exists. The chunks' means are weighted by their counted tokens."""
        counted = (targets != -100).sum().clamp(min=1)
        step = max(1, self.loss_chunk // x.shape[0])  # whole sequences' columns: (b, step) tokens a chunk

        def part(xc, tc):
            return self.output_loss(self.head(xc), tc) * (tc != -100).sum()

        total = None
        for lo in range(0, targets.shape[1], step):
            xc, tc = x[:, lo:lo + step], targets[:, lo:lo + step]
            term = checkpoint(part, xc, tc, use_reentrant=False) if torch.is_grad_enabled() else part(xc, tc)
            total = term if total is None else total + term
        return total / counted

    def aux_loss(self, modules) -> torch.Tensor | None:
        """``router_aux_loss_coef`` x the summed load-balancing losses of the MoE layers among
        ``modules`` (and their submodules) after their forward; None when there are none."""
        if self.cfg.num_experts <= 1 or not self.cfg.router_aux_loss_coef:
            return None  # no MoE layer (layers/moe.py: is_moe_layer), or no weight: nothing to walk per forward
        seen, moe = set(), []
        for mod in modules:
            for m in mod.modules():
                if isinstance(m, MoE) and id(m) not in seen:
                    seen.add(id(m))
                    moe.append(m)
        if not moe or not self.cfg.router_aux_loss_coef:
            return None
        return self.cfg.router_aux_loss_coef * torch.stack([m.aux_loss for m in moe]).sum()

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, aux: bool = True) -> torch.Tensor:
        """Mean next-token cross-entropy (float32) over the tokens this rank holds.

        With ``document_eos`` set, each document of a packed window is run as if alone: its
        tokens attend within it and rotary positions restart at its first token.

        ``aux``: add a MoE model's load-balancing loss (training); evaluation leaves it out.
        """
        positions = docs = None
        if self.document_eos is not None:  # masks and positions per document (layers/documents.py)
            docs = document_ids(tokens, self.document_eos)
            positions = document_positions(docs)
        if self.seq_layout is not None:
            tokens, targets = self.seq_layout.local(tokens), self.seq_layout.local(targets)
            positions = None if positions is None else self.seq_layout.local(positions)
        if self.loss_chunk and self.loss_chunk < tokens.numel():
            loss = self.chunked_loss(self.hidden(tokens, positions, docs), targets)
        else:
            loss = self.output_loss(self(tokens, positions, docs), targets)
        extra = self.aux_loss([self]) if aux else None
        return loss if extra is None else loss + extra
