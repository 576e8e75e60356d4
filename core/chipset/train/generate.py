"""Sampling from a run's checkpoint in one process (``chipset generate``).

The checkpoint (any layout's shards) is read whole (:func:`~chipset.train.checkpoint.export.load_weights`),
the family's model is built unsharded on the host and completions are drawn with the KV-cache
sampler of :mod:`chipset.models.sampling`. Text goes in and out through the run's own tokenizer:
the one its prepared tokens were made with, else ``model.init_from``'s (the tokenizer
``chipset export`` carries); bytes for ``data.source = "text"``; token ids otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chipset.errors import ConfigError

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["Completion", "Generated", "generate"]


@dataclass
class Completion:
    ids: list[int]
    text: str | None
    stopped: bool
    """Ended at the end-of-sequence id (else at max_new_tokens)."""


@dataclass
class Generated:
    checkpoint: str
    tokenizer: str
    """What encoded the prompt: a tokenizer.json path, "bytes" or "token ids"."""
    prompt_ids: list[int]
    prompt_text: str
    completions: list[Completion] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class _Codec:
    """Text <-> ids for a run: its tokenizer.json, UTF-8 bytes, or none (ids only)."""

    def __init__(self, cfg):
        from chipset.train.checkpoint.export import carry_tokenizer

        self.tok, self.name, self.eos = None, "token ids", None
        carried = carry_tokenizer(cfg)
        path = carried.files.get("tokenizer.json")
        if path is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ConfigError(f"the run's tokenizer {path} needs the tokenizers package: "
                                  "pip install 'chipset[data]' (or give --prompt-ids)") from None
            self.tok, self.name = Tokenizer.from_file(str(path)), str(path)
        elif cfg.data.source == "text":
            self.name = "bytes"
        eos = carried.ids.get("eos_token_id")
        self.eos = eos if isinstance(eos, int) else None

    def encode(self, text: str) -> list[int]:
        if self.tok is not None:
            return self.tok.encode(text, add_special_tokens=False).ids
        if self.name == "bytes":
            return list(text.encode("utf-8"))
        raise ConfigError("the run has no tokenizer (synthetic data, no model.init_from): give the prompt as "
                          "token ids with --prompt-ids I,J,...")

    def decode(self, ids: list[int]) -> str | None:
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=False)
        if self.name == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return None


def generate(run_dir: str | Path, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
             step: int | None = None, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
             greedy: bool = False, num: int = 1, seed: int = 0, backend: Backend=None) -> Generated:
    """Completions of ``prompt`` (text) or ``prompt_ids`` from checkpoint ``step`` of ``run_dir``."""
    from chipset.loader import backend as load_backend
    from chipset.models.family import build_for
    from chipset.models.registry import resolve_family
    from chipset.models.sampling import sample
    from chipset.parallel.linear import apply_linear
    from chipset.train.checkpoint.export import load_weights
    from chipset.train.evaluate import family_unit

    cfg, weights, ckpt = load_weights(run_dir, step)
    family = resolve_family(cfg.model.family)
    if cfg.data.source == "images" or family_unit(family, cfg) != "tokens":
        raise ConfigError(f"model family {family.name!r} does not produce tokens: chipset generate samples from "
                          "decoder families (transformer, gpt2, Hugging Face models)")
    codec = _Codec(cfg)
    ids = list(prompt_ids) if prompt_ids is not None else codec.encode(prompt or "")
    if not ids:
        raise ConfigError("the prompt encodes to no tokens: give a non-empty --prompt or --prompt-ids")
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if bad:
        raise ConfigError(f"prompt token ids {bad[:5]} are outside the model's vocabulary 0..{cfg.model.vocab_size - 1}")
    b = backend or load_backend()
    model = apply_linear(build_for(family, cfg, b.kernels), b.kernels)  # training's GEMM
    model.load_state_dict(weights)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    start = torch.tensor([ids] * num, dtype=torch.long)
    temp = 1e-6 if greedy else temperature  # the argmax, through the same sampler
    stops = (codec.eos,) if codec.eos is not None else ()
    out, mask = sample(model, start, max_new_tokens=max_new_tokens, temperature=temp, top_p=1.0 if greedy else top_p,
                       stop_ids=stops, generator=gen, vocab_size=cfg.model.vocab_size)
    res = Generated(str(ckpt), codec.name, ids, codec.decode(ids) or "")
    for row, keep in zip(out.tolist(), mask.tolist(), strict=True):
        got = [t for t, k in zip(row, keep, strict=True) if k]
        stopped = bool(stops) and bool(got) and got[-1] in stops
        res.completions.append(Completion(got, codec.decode(got), stopped))
    return res
