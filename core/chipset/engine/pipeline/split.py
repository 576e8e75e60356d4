"""Splitting the reference Transformer into pipeline stages.

The model is a sequence of units ``[embedding, block 0 .. block L-1, head]``. It is cut
into ``p*v`` contiguous pieces (virtual stages), either balanced by parameter count
(minimising the largest piece) or as an explicit list of blocks per virtual stage
(``parallel.pipeline_split = "3,2,2,1"``). The embedding always lands on virtual stage 0,
the head (final norm, logits, loss) on the last.

A rank's pieces live in one :class:`StageModel` whose parameter names are exactly the
single-process names (``layers.3.mlp.up_proj.weight``), so data parallelism, params
digests and checkpoints see the same names whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chipset.errors import ConfigError
from chipset.models.moe import MoE

__all__ = ["StageSpec", "StageModel", "balanced_runs", "parse_split", "read_counts", "split_model"]


@dataclass(frozen=True)
class StageSpec:
    """What one virtual stage holds: the embedding?, blocks ``[first, last)``, the head?"""

    virtual_stage: int
    first: int
    last: int
    embed: bool
    head: bool

    @property
    def layers(self) -> range:
        return range(self.first, self.last)

    def describe(self) -> str:
        parts = (["embedding"] if self.embed else []) + (
            [f"blocks {self.first}-{self.last - 1}" if self.last - self.first > 1 else f"block {self.first}"]
            if self.last > self.first else []) + (["head+loss"] if self.head else [])
        return ", ".join(parts)


def read_counts(text: str, parts: int, what: str) -> tuple[list[int], list[str]]:
    """``parallel.pipeline_split`` as integers (ConfigError if it is not a comma-separated list
    of ``what`` counts), and the problem of an entry count other than ``parts``."""
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise ConfigError(
            f"parallel.pipeline_split = {text!r}: expected comma-separated {what} counts per virtual stage, "
            f"e.g. \"{','.join(['1'] * parts)}\""
        ) from None
    return counts, ([] if len(counts) == parts else
                    [f"has {len(counts)} entries, expected pp*virtual_stages = {parts}"])


def parse_split(text: str, parts: int, num_layers: int) -> list[int]:
    """``"2,2"`` -> [2, 2]; the list must have ``parts`` entries summing to ``num_layers``."""
    counts, problems = read_counts(text, parts, "block")
    if sum(counts) != num_layers:
        problems.append(f"sums to {sum(counts)} blocks, expected model.num_hidden_layers = {num_layers}")
    if any(c < 0 for c in counts):
        problems.append("has a negative count")
    elif len(counts) == parts and any(c == 0 for c in counts[1:-1]):
        problems.append("leaves a middle virtual stage without blocks (only the first and last hold the "
                        "embedding or head and may have 0 blocks)")
    if problems:
        raise ConfigError(f"parallel.pipeline_split = {text!r} " + "; ".join(problems))
    return counts


def balanced_runs(weights: list[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` non-empty contiguous runs minimising the largest sum; run lengths."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible max over the first i units cut into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        lengths.append(i - j)
        i = j
    return lengths[::-1]


def split_model(model, parts: int, explicit: str = "") -> list[StageSpec]:
    """One :class:`StageSpec` per virtual stage of ``model`` (a :class:`chipset.models.Transformer`)."""
    n_layers = len(model.layers)
    if explicit:
        counts = parse_split(explicit, parts, n_layers)
    else:
        units = 2 + n_layers
        if parts > units:
            raise ConfigError(
                f"pp*virtual_stages ({parts}) exceeds the model's {units} pipeline units (embedding, "
                f"{n_layers} blocks, head); use fewer stages or more model.num_hidden_layers"
            )
        weights = [sum(p.numel() for p in m.parameters()) for m in (model.embed_tokens, *model.layers, model.head)]
        lengths = balanced_runs(weights, parts)
        # Units -> blocks per stage: the first run includes the embedding, the last the head.
        counts = list(lengths)
        counts[0] -= 1
        counts[-1] -= 1
        if parts == 1:
            counts = [n_layers]
    specs, first = [], 0
    for s, c in enumerate(counts):
        specs.append(StageSpec(s, first, first + c, embed=s == 0, head=s == parts - 1))
        first += c
    return specs


class StageModel(nn.Module):
    """The pieces of the model one pipeline rank holds, under their single-process names.

    ``chunk_forward(c, x)`` runs this rank's chunk ``c``: token ids in and hidden states
    out on the first virtual stage, hidden states through on the middle ones, logits out
    on the last.
    """

    def __init__(self, model, specs: list[StageSpec]):
        super().__init__()
        self.specs = specs
        self.recompute = model.recompute
        self._k = model._k
        self.loss_fn = getattr(model, "loss_fn", None) or model._k.cross_entropy
        if any(s.embed for s in specs):
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[i] for s in specs for i in s.layers})
        if any(s.head for s in specs):
            self.head = model.head
        self.seq_layout = model.seq_layout  # context parallel: this rank's tokens of each sequence
        self.aux_loss_coef = model.cfg.router_aux_loss_coef
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def units(self) -> list[nn.Module]:
        """What ZeRO-3 gathers together, in forward order (``Transformer.units`` of what this rank holds)."""
        return ([self.embed_tokens] if hasattr(self, "embed_tokens") else []) + list(self.layers.values()) + (
            [self.head] if hasattr(self, "head") else [])

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` (batch, seq): all of them, or its cp share."""
        return t if self.seq_layout is None else self.seq_layout.local(t)

    def chunk_forward(self, chunk: int, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``x``: this rank's token ids (first virtual stage) or hidden states (as the previous
        stage left them: cp share, and with sequence parallelism this tp rank's slice of it);
        ``seq_len``: the whole sequence's length, for the rotary positions."""
        spec = self.specs[chunk]
        dtype = self.rope_cos.dtype
        if self.seq_layout is None:
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        else:
            pos = self.seq_layout.positions(seq_len, self.rope_cos.device)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        cos, sin = cos.to(dtype), sin.to(dtype)
        if spec.embed:
            x = self.embed_tokens(x)
        for i in spec.layers:
            block = self.layers[str(i)]
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        if spec.head:
            x = self.head(x)
        return x

    def aux_loss(self, chunk: int) -> torch.Tensor | None:
        """``router_aux_loss_coef`` x the summed load-balancing losses of chunk ``chunk``'s MoE layers after
        its forward (``Transformer.loss`` adds every layer's); None when it holds none."""
        moe = [m for i in self.specs[chunk].layers if isinstance(m := self.layers[str(i)].mlp, MoE)]
        if not moe or not self.aux_loss_coef:
            return None
        return self.aux_loss_coef * torch.stack([m.aux_loss for m in moe]).sum()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, exactly as ``Transformer.loss``."""
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
