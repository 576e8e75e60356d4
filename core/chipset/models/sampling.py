"""Batched sampling with a KV cache from an unsharded decoder (the rollout replica).

:func:`sample` draws completions for a batch of equally long prompts (the G completions of
one prompt): one prefill over the prompt, then one token at a time, each step attending to
the keys and values cached so far. The built-in transformer and gpt2 have a cached step here
(:func:`decoder_step`); any other family samples by running its whole forward on the growing
sequence (correct, quadratic).

Randomness comes from the ``torch.Generator`` passed in only, so a group's completions are the
same on every rank and layout that samples it with the same seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KVCache", "decoder_step", "sample", "filter_top_p"]


class KVCache:
    """Keys and values of every layer so far: ``[batch, kv_heads, positions, head_dim]`` each."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions ``start..`` over keys ``0..``; kv heads repeated (GQA)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s, t = q.shape[2], k.shape[2]
    mask = torch.arange(t, device=q.device)[None, :] <= (start + torch.arange(s, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _transformer_step(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    start = cache.length
    b, s = tokens.shape
    dtype = model.embed_tokens.weight.dtype
    cos, sin = model.rotary.at(torch.arange(start, start + s, device=tokens.device), dtype)
    k_ = model._k
    x = model.embed_tokens(tokens)
    for i, block in enumerate(model.layers):
        att = block.self_attn
        h = block.input_layernorm(x)
        q = att.q_proj(h).view(b, s, -1, att.head_dim)
        k = att.k_proj(h).view(b, s, -1, att.head_dim)
        if hasattr(att, "q_norm"):
            q, k = att.q_norm(q), att.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = att.v_proj(h).view(b, s, -1, att.head_dim).transpose(1, 2)
        q, k = k_.rotary_embedding(q, cos, sin), k_.rotary_embedding(k, cos, sin)
        k, v = cache.append(i, k, v)
        x = x + att.o_proj(_attend(q, k, v, start).transpose(1, 2).reshape(b, s, -1))
        x = x + block.mlp(block.post_attention_layernorm(x))
    cache.length += s
    return model.head(x)


def _gpt2_step(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    start = cache.length
    b, s = tokens.shape
    emb = model.embed
    x = emb.wte(tokens) + emb.wpe(torch.arange(start, start + s, device=tokens.device))
    for i, block in enumerate(model.h):
        att = block.attn
        h = block.ln_1(x)

        def heads(t, att=att):
            return t.view(b, s, -1, att.head_dim).transpose(1, 2)

        q, k, v = heads(att.q_proj(h)), heads(att.k_proj(h)), heads(att.v_proj(h))
        k, v = cache.append(i, k, v)
        x = x + att.o_proj(_attend(q, k, v, start).transpose(1, 2).reshape(b, s, -1))
        x = x + block.mlp(block.ln_2(x))
    cache.length += s
    return model.head(x)


def decoder_step(model: nn.Module):
    """``(step(model, new_tokens, cache) -> logits of the new tokens, layers)`` for a family with a
    cached decode here, else None (the built-in transformer and gpt2, by their module classes)."""
    from chipset.models.gpt2 import GPT2
    from chipset.models.transformer import Transformer

    if isinstance(model, Transformer) and getattr(model, "seq_layout", None) is None:
        return _transformer_step, len(model.layers)
    if isinstance(model, GPT2):
        return _gpt2_step, len(model.h)
    return None


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (rows sum to 1) with everything outside each row's nucleus zeroed: the smallest
    set of most likely tokens whose total reaches ``top_p`` (the most likely is always kept)."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]
          ) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs = filter_top_p(probs, top_p)
    # Inverse CDF with uniforms from the generators on the host: the same draw on any device,
    # each block of rows from its own generator (a group samples alike in any batch).
    per = probs.shape[0] // len(generators)
    u = torch.cat([torch.rand(per, generator=g, dtype=torch.float64) for g in generators]).to(probs.device)
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    return torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(model: nn.Module, prompt: torch.Tensor, *, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, stop_ids: tuple[int, ...] = (),
           generator: torch.Generator | list[torch.Generator],
           vocab_size: int | None = None, use_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions of ``prompt`` (``[batch, prompt_len]`` token ids, on the model's device).

    Returns ``(tokens, mask)``: ``[batch, max_new_tokens]`` sampled ids (0 after a row stopped) and
    the 0/1 mask of the tokens that belong to each completion (up to and including its first stop
    id). ``vocab_size``: logits beyond it (a padded vocabulary) are never drawn. ``generator``: one,
    or a list of k that each draw for ``batch / k`` consecutive rows (several groups in one batch,
    each sampling as it would alone)."""
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if prompt.shape[0] % len(generators):
        raise ValueError(f"{prompt.shape[0]} rows do not split evenly over {len(generators)} generators")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b = prompt.shape[0]
    step = decoder_step(model) if use_cache else None
    cache = KVCache(step[1]) if step is not None else None
    out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=prompt.device)
    mask = torch.zeros(b, max_new_tokens, dtype=torch.long, device=prompt.device)
    alive = torch.ones(b, dtype=torch.bool, device=prompt.device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=prompt.device)
    seq = prompt
    logits = step[0](model, prompt, cache)[:, -1] if step is not None else model(prompt)[:, -1]
    for t in range(max_new_tokens):
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        nxt = _draw(logits, temperature, top_p, generators)
        nxt = torch.where(alive, nxt, torch.zeros_like(nxt))
        out[:, t] = nxt
        mask[:, t] = alive.long()
        alive = alive & ~torch.isin(nxt, stops)
        if not bool(alive.any()) or t == max_new_tokens - 1:
            break
        if step is not None:
            logits = step[0](model, nxt[:, None], cache)[:, -1]
        else:
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            logits = model(seq)[:, -1]
    return out, mask
