"""LoRA adapters (Hu et al., 2021) on a model's linear layers, named in the tp plans' pattern vocabulary.

A targeted layer computes ``y = base(x) + scale * B(A(dropout(x)))`` with ``A: [rank, in]``,
``B: [out, rank]`` and ``scale = alpha / rank``. ``A`` starts as ``nn.Linear``'s default
(Kaiming-uniform) and ``B`` at zero, so training starts from the base model's function. Every
parameter that is not an adapter is frozen (``requires_grad=False``): the engine gives frozen
parameters value-only buckets (no gradient, no master weight, no optimizer state), so optimizer
memory is proportional to the adapters.

The adapters live in the targeted module as ``lora_A.weight`` and ``lora_B.weight``
(``layers.0.self_attn.q_proj.lora_A.weight``: PEFT's names, without its prefix) and the base's
parameter names do not change, so Hugging Face weights (``model.init_from``) load as without LoRA.

Under tensor parallelism the adapters follow the base layer's split (parallel/tensor.py):

* column-parallel base (``W`` split by output rows): ``B`` is split the same way, ``A`` is
  replicated. ``h = x A^T`` is computed once per rank; for a layer that enters the tp region itself,
  ``h`` (rank wide, cheap) enters it instead of ``x``: the all-reduce of its gradient sums the
  ranks' partial ``B_r^T g_r`` so ``A``'s gradient is whole; under sequence parallelism ``h`` is
  gathered along the sequence. For a layer reading a region norm's output, ``x`` is in the region
  already (its gradient is all-reduced there), so ``A`` enters it instead: its partial gradients
  are all-reduced.
* row-parallel base (``W`` split by input columns): ``A`` is split by input columns, ``B`` is
  replicated. ``x_r A_r^T`` are partial sums of ``x A^T``: reduced over tp (reduce-scattered along
  the sequence under sequence parallelism, where ``B`` then sees this rank's slice only and its
  gradient is all-reduced).

Initial values come from a generator seeded by ``train.seed`` and the layer's name, so every
layout starts from the same adapters (each rank keeps its slice of the full tensors).
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chipset.errors import ConfigError
from chipset.parallel.linear import KernelLinear
from chipset.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    _sharded_param,
    copy_to_group,
    enter_region,
    reduce_from_group,
    reduce_scatter_along_grad,
)

__all__ = ["ADAPTER_NAMES", "LoRA", "apply_lora", "default_targets", "is_adapter", "lora_of", "merge",
           "target_patterns", "target_problems"]

ADAPTER_NAMES = ("lora_A", "lora_B")
TARGET_STYLES = ("colwise", "colwise_in_region", "rowwise")
"""The tp plan styles whose modules LoRA targets by default: the attention and MLP projections."""
_SEQ = 1
LINEAR_TYPES = (nn.Linear, KernelLinear, ColumnParallelLinear, RowParallelLinear)
"""The modules LoRA adapts (exact types: y = x W^T + b, which the adapter's output is added to)."""


@dataclass(frozen=True)
class LoRA:
    """``model.lora_*``: rank, alpha (scale = alpha / rank), dropout on the adapter's input, targets."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_of(cfg, family) -> LoRA | None:
    """The LoRA settings of run config ``cfg`` (None when ``model.lora_rank`` is 0)."""
    m = cfg.model
    if not m.lora_rank:
        return None
    return LoRA(m.lora_rank, m.lora_alpha, m.lora_dropout, tuple(target_patterns(cfg, family)))


def default_targets(plan: dict[str, str]) -> list[str]:
    """The patterns of a tp plan that split linear projections (colwise / rowwise)."""
    return [p for p, s in plan.items() if s in TARGET_STYLES]


def target_patterns(cfg, family) -> list[str]:
    """``model.lora_targets`` (comma-separated module-name patterns), or the family plan's projections."""
    given = [p.strip() for p in cfg.model.lora_targets.split(",") if p.strip()]
    return given or default_targets(family.plan(cfg))


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter (``....lora_A.weight`` / ``....lora_B.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in ADAPTER_NAMES


def _matches(model: nn.Module, patterns) -> dict[str, list[str]]:
    """pattern -> module names it matches (modules inside adapters excluded)."""
    out = {p: [] for p in patterns}
    for name, _ in model.named_modules():
        if not name or name.split(".")[-1] in ADAPTER_NAMES:
            continue
        for p in patterns:
            if fnmatch.fnmatchcase(name, p):
                out[p].append(name)
                break
    return out


def target_problems(model: nn.Module, patterns, where: str = "model.lora_targets") -> list[str]:
    """Why ``patterns`` cannot target ``model`` (built on the meta device is enough): a pattern
    matching nothing, or a module that is not a linear layer."""
    modules = dict(model.named_modules())
    if not patterns:
        linear = [n for n, m in modules.items() if type(m) in LINEAR_TYPES]
        return [f"{where}: no patterns and the model family's tp plan names no colwise/rowwise projection; "
                "name the nn.Linear layers to adapt (comma-separated patterns); this model's are "
                + (", ".join(linear[:6]) + (", ..." if len(linear) > 6 else "") if linear else "none")]
    problems = []
    for pattern, names in _matches(model, patterns).items():
        if not names:
            problems.append(f"{where}: pattern {pattern!r} matches no module of the model; module names look "
                            f"like {', '.join(list(modules)[1:4])} (print(model) lists them)")
        bad = [n for n in names if type(modules[n]) not in LINEAR_TYPES]
        if bad:  # a subclass may transform its input before the matmul (ResNet's pooled head): not x W^T
            problems.append(f"{where}: pattern {pattern!r} matches {bad[0]} ({type(modules[bad[0]]).__name__}); "
                            "LoRA adapts plain nn.Linear layers only; narrow the pattern")
    return problems


class _Weight(nn.Module):
    """Holds one adapter matrix as ``weight`` (so it is named ``lora_A.weight``, as PEFT names it)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def _full_adapters(name: str, in_f: int, out_f: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    a = torch.empty(rank, in_f)
    bound = 1 / math.sqrt(in_f)  # nn.Linear's default: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    a.uniform_(-bound, bound, generator=gen)
    return a, torch.zeros(out_f, rank)


def _logical(p: torch.Tensor, dim: int) -> int:
    shard = getattr(p, "_chipset_tp_shard", None)
    return p.shape[dim] if shard is None else shard.size


class _Adapter:
    """The forward hook adding ``scale * B(A(dropout(x)))`` to a targeted layer's output."""

    def __init__(self, lora: LoRA, kind: str, tp: TPContext | None, enters: bool, linear):
        self.scale, self.p, self.kind, self.tp, self.enters = lora.scale, lora.dropout, kind, tp, enters
        self.linear = linear

    def __call__(self, mod: nn.Module, args, y: torch.Tensor) -> torch.Tensor:
        x = F.dropout(args[0], self.p, training=mod.training) if self.p else args[0]
        a, b, t, lin = mod.lora_A.weight, mod.lora_B.weight, self.tp, self.linear
        if self.kind == "col" and self.enters:
            h = enter_region(lin(x, a), t)
        elif self.kind == "col":
            h = lin(x, copy_to_group(a, t.collective, t.group))
        elif self.kind == "row":
            h = lin(x, a)
            if t.sequence_parallel:
                h = reduce_scatter_along_grad(h, _SEQ, t.collective, t.group)
                b = copy_to_group(b, t.collective, t.group)
            else:
                h = reduce_from_group(h, t.collective, t.group)
        else:
            h = lin(x, a)
        return y + lin(h, b) * self.scale


def apply_lora(model: nn.Module, lora: LoRA, *, seed: int, tp: TPContext | None = None,
               linear=F.linear) -> list[str]:
    """Freeze ``model`` and add adapters to every module ``lora.targets`` match (after the tp plan
    is applied: they follow its split). ``linear``: the adapters' product (the backend's ``linear``
    kernel, resolved: parallel/linear.py). Returns the adapted module names; ConfigError on a bad target."""
    problems = target_problems(model, lora.targets)
    if problems:
        raise ConfigError("; ".join(problems))
    for p in model.parameters():
        p.requires_grad_(False)
    names = [n for ns in _matches(model, lora.targets).values() for n in ns]
    for name in names:
        mod = model.get_submodule(name)
        w = mod.weight
        if isinstance(mod, ColumnParallelLinear):
            a, b = _full_adapters(name, w.shape[1], _logical(w, 0), lora.rank, seed)
            pa, pb, kind = nn.Parameter(a), _sharded_param(b, 0, mod.tp), "col"
        elif isinstance(mod, RowParallelLinear):
            a, b = _full_adapters(name, _logical(w, 1), w.shape[0], lora.rank, seed)
            pa, pb, kind = _sharded_param(a, 1, mod.tp), nn.Parameter(b), "row"
        else:
            a, b = _full_adapters(name, w.shape[1], w.shape[0], lora.rank, seed)
            pa, pb, kind = nn.Parameter(a), nn.Parameter(b), "plain"
        mod.lora_A, mod.lora_B = _Weight(pa), _Weight(pb)
        mod.register_forward_hook(_Adapter(lora, kind, getattr(mod, "tp", tp), getattr(mod, "enter_region", False),
                                           linear))
    return names


def merge(tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Logical tensors by name with every adapter pair folded into its base weight
    (``W + scale * B @ A``, in float32) and the adapters dropped."""
    out = {n: t for n, t in tensors.items() if not is_adapter(n)}
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            base = name.removesuffix(".lora_A.weight")
            b = tensors[f"{base}.lora_B.weight"]
            w = out[f"{base}.weight"]
            out[f"{base}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
