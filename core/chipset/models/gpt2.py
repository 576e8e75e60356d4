"""A GPT-2-style decoder: the second transformer family, written only against the contract.

LayerNorm (with bias), GELU (tanh approximation), learned absolute positions, biases on
every projection, separate (not tied) input and output embeddings. It reaches data, tensor
and pipeline parallelism and ZeRO purely through the family contract
(chipset.models.family): a tensor-parallel plan over its ``nn.Linear`` layers and a chain of
pipeline units. The engine has no code for it. Select it with ``model.family = "gpt2"``
(docs/models.md).

The ``model.*`` keys it reads: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``intermediate_size`` (the MLP width; GPT-2 uses 4 x hidden),
``max_position_embeddings``, ``init_std``. Every other ``model.*`` key is the built-in
decoder's and is ignored.

Why the output embedding is not tied to the input one (GPT-2 ties them): under pp the two
live on different stages, and a tied weight would need its gradient summed across stages.
The contract has no such cross-stage tie yet; an untied head is the same architecture with
``vocab x hidden`` more parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from chipset.models.family import ModelFamily
from chipset.parallel.plan import LAYOUTS

__all__ = ["GPT2", "GPT2Family", "family"]


class Embeddings(nn.Module):
    """Token plus learned position embedding: the first pipeline unit."""

    def __init__(self, vocab: int, hidden: int, positions: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(positions, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(pos)


class Attention(nn.Module):
    """Causal multi-head attention. The head count comes from the projection's width, so a
    tensor-parallel plan that splits q, k and v by columns leaves each rank whole heads."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc_in = nn.Linear(hidden, inner)
        self.fc_out = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, hidden: int, heads: int, inner: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: the last pipeline unit."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2(nn.Module):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, inner: int, positions: int,
                 init_std: float = 0.02):
        super().__init__()
        self.embed = Embeddings(vocab, hidden, positions)
        self.h = nn.ModuleList(Block(hidden, heads, inner) for _ in range(layers))
        self.head = Head(hidden, vocab)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # LayerNorm weights one, every bias zero
                if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            else:  # GPT-2: N(0, std), the residual projections scaled by 1/sqrt(2 x layers)
                scale = 1 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "fc_out.weight")) else 1.0
                nn.init.normal_(p, std=init_std * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.h:
            x = block(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        """Embeddings, each block, the head: ZeRO-3's gather units and the pipeline chain."""
        return [self.embed, *self.h, self.head]


class GPT2Family(ModelFamily):
    """The contract's answers for :class:`GPT2` on token sequences (``data.*``)."""

    name = "gpt2"
    layouts = frozenset(x for x in LAYOUTS if x not in ("sp", "ep", "cp"))
    tp_plan = {
        # Megatron-LM's split: q, k, v and the MLP's first layer by output columns (whole heads
        # per rank), the attention output and the MLP's second layer by input rows; the token
        # embedding and the logits by vocabulary rows (the loss then sums over tp ranks).
        "h.*.attn.q_proj": "colwise", "h.*.attn.k_proj": "colwise", "h.*.attn.v_proj": "colwise",
        "h.*.attn.o_proj": "rowwise",
        "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise",
        "embed.wte": "vocab_embedding", "head.lm_head": "vocab_head",
    }

    def build(self, cfg) -> GPT2:
        m = cfg.model
        return GPT2(m.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
                    m.intermediate_size, m.max_position_embeddings, m.init_std)

    def problems(self, cfg) -> list[str]:
        m, tp = cfg.model, cfg.parallel.tp
        out = super().problems(cfg)  # the token data's own rules
        if m.num_attention_heads < 1 or m.hidden_size % m.num_attention_heads:
            out.append(f"model.num_attention_heads ({m.num_attention_heads}) must divide model.hidden_size "
                       f"({m.hidden_size}) for model family 'gpt2'")
        elif m.num_attention_heads % tp:
            out.append(f"parallel.tp = {tp} must divide model.num_attention_heads ({m.num_attention_heads}): "
                       "each tensor-parallel rank holds whole heads")
        if cfg.train.seq_len > m.max_position_embeddings:
            out.append(f"train.seq_len ({cfg.train.seq_len}) must be <= model.max_position_embeddings "
                       f"({m.max_position_embeddings}) for model family 'gpt2' (learned positions)")
        return out

    def flops_per_sample(self, cfg) -> float:
        """Training FLOPs of one sequence: 6 per weight of every ``nn.Linear`` per token (forward
        and the two backward products) plus the attention scores and values, 12 x layers x
        hidden x seq per token (PaLM's count, no causal halving). Equal to what
        torch.utils.flop_counter counts for a training step (tests/models/test_gpt2_family.py)."""
        m, s = cfg.model, cfg.train.seq_len
        h, inner, L = m.hidden_size, m.intermediate_size, m.num_hidden_layers
        linear = L * (4 * h * h + 2 * h * inner) + h * m.vocab_size
        return float(s * (6 * linear + 12 * L * h * s))


def family() -> GPT2Family:
    return GPT2Family()
