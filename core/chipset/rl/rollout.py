"""Rollout engines and the weight stream that keeps one in step with the trained policy.

A rollout engine generates completions; it implements :class:`RolloutEngine`. The built-in one,
:class:`LocalRollout`, samples in this process from an unsharded replica of the policy with a
KV cache (models/sampling.py). An adapter for vLLM or SGLang implements the same two methods:
``load_weights`` takes the ``(hf_name, tensor)`` pairs of :func:`stream_weights` (in memory,
no files; vLLM's ``model.load_weights(weights=...)`` takes exactly such an iterable) after each
update, and ``generate`` returns token ids and masks. docs/rl.md shows one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from chipset.models.family import build_for
from chipset.models.hf.config import SUPPORTED_ARCHITECTURES, _family_of
from chipset.models.hf.names import expert_names, to_hf
from chipset.models.sampling import sample
from chipset.parallel.linear import apply_linear
from chipset.parallel.lora import apply_lora, lora_of
from chipset.parallel.meta import on_meta

__all__ = ["SamplingParams", "RolloutEngine", "LocalRollout", "stream_weights", "hf_namer"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()


@runtime_checkable
class RolloutEngine(Protocol):
    """What generates completions for the RL loop."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the policy's full weights, by Hugging Face name (:func:`stream_weights`)."""

    def generate(self, prompts: list[torch.Tensor], n: int, params: SamplingParams, seeds: list[int]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` completions of each prompt (1-D tensors of token ids): per prompt, ``[n,
        max_new_tokens]`` ids and their 0/1 completion mask (tokens up to and including the first
        stop id). The same seed gives the same completions of a prompt, whatever else is in the call."""


def hf_namer(cfg):
    """``chipset name -> [hf names], split`` for the model of ``cfg`` (the names export writes)."""
    family = SUPPORTED_ARCHITECTURES.get(cfg.model.architecture) if cfg.model.architecture else None
    if family is None:
        try:
            family = _family_of(cfg.model)[1]
        except KeyError:
            family = "llama"

    def names(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        experts = expert_names(name, family, t.shape[0]) if t.dim() else None
        if experts is None:
            return [(to_hf(name, family), t)]
        return [(e, t[i]) for i, e in enumerate(experts)]

    return names, family


def stream_weights(engine, cfg=None, hf_names: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full tensors after an update, one at a time, on every rank (collective:
    every rank of the job iterates to the end). Names are Hugging Face's (``model.layers.0...``)
    for the built-in transformer with ``cfg`` given, else chipset's own. Tensors are float32 on
    the host and the caller's to keep; nothing is written to disk."""
    if not hf_names or cfg is None or cfg.model.family not in ("transformer", ""):
        yield from engine.iter_full_parameters()
        return
    names, _ = hf_namer(cfg)
    for name, t in engine.iter_full_parameters():
        yield from names(name, t)


class LocalRollout:
    """Sampling in this process from an unsharded replica of the policy (the family's model with
    the run's LoRA adapters, built once, weights from :meth:`load_weights`), with a KV cache where
    the family has one. It takes a stream by chipset's names or by the Hugging Face names of
    :func:`stream_weights` (each expert of a stacked MoE tensor by its own name)."""

    def __init__(self, family, cfg, device: torch.device, kernels=None):
        with on_meta():
            model = build_for(family, cfg, kernels)
            if kernels is not None:  # the GEMM the policy trains with, before LoRA as there (parallel/linear.py)
                model = apply_linear(model, kernels)
            lora = lora_of(cfg, family)
            if lora is not None:
                apply_lora(model, lora, seed=cfg.train.seed,
                           linear=F.linear if kernels is None else kernels.resolve("linear"))
        self.model = model.to_empty(device=device).eval()
        self.cfg = cfg
        self.vocab_size = cfg.model.vocab_size
        # destination of each streamed name: a parameter, or a view of one (an expert's slice)
        self._into: dict[str, tuple[str, torch.Tensor]] = {}
        self._parts: dict[str, int] = {}
        namer = hf_namer(cfg)[0] if cfg.model.family in ("transformer", "") else None
        for name, p in self.model.named_parameters():
            pieces = namer(name, p.data) if namer is not None else []
            self._into[name] = (name, p.data)
            self._into.update({hf: (name, view) for hf, view in pieces if hf != name})
            self._parts[name] = max(len(pieces), 1)
        for name, buf in self.model.named_buffers():  # non-persistent tables stay as built
            self._into.setdefault(name, (name, buf))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        got: dict[str, int] = {}
        for name, t in weights:
            if name not in self._into:
                raise KeyError(f"LocalRollout: no parameter {name!r} in the replica (expected chipset's or "
                               "Hugging Face's names, as chipset.rl.rollout.stream_weights yields them)")
            local, dst = self._into[name]
            dst.copy_(t)
            got[local] = got.get(local, 0) + (self._parts[local] if name == local else 1)
        missing = [n for n, k in self._parts.items() if got.get(n, 0) < k]
        if missing:
            raise KeyError(f"LocalRollout: the weight stream had no {missing[:3]} (or not every expert of them)")

    def generate(self, prompts: list[torch.Tensor], n: int, params: SamplingParams, seeds: list[int]):
        """Prompts of equal length are sampled in one batch, each group from its own seed."""
        dev = next(self.model.parameters()).device
        out: list = [None] * len(prompts)
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(p.numel(), []).append(i)
        for idx in by_len.values():
            batch = torch.stack([prompts[i] for i in idx]).to(dev).repeat_interleave(n, dim=0)
            gens = [torch.Generator().manual_seed(int(seeds[i])) for i in idx]
            toks, mask = sample(self.model, batch, max_new_tokens=params.max_new_tokens,
                                temperature=params.temperature, top_p=params.top_p, stop_ids=params.stop_ids,
                                generator=gens, vocab_size=self.vocab_size)
            for k, i in enumerate(idx):
                out[i] = (toks[k * n:(k + 1) * n], mask[k * n:(k + 1) * n])
        return out
