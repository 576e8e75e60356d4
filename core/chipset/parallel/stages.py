"""Pipeline stages of a model family: contiguous runs of its pipeline units.

A family (chipset.models.family) describes its model as a chain of units
(``ModelFamily.pipeline_units``): applied one after another they compute the model's forward.
The chain is cut into ``pp * virtual_stages`` runs, balanced by parameter count or as given
by ``parallel.pipeline_split`` (read by the family: ``ModelFamily.pipeline_counts``). A rank's
runs live in one :class:`UnitStageModel` whose parameter names are the single-process names,
so data parallelism, ZeRO, checkpoints and digests see one model whatever the split.

Nothing here knows a family's modules: it reads, from the model bound to its family (a
:class:`chipset.models.family.BoundModel`, ``bound``), the chain, its parameters, the family's
auxiliary losses (``bound.aux_loss(units)``) and output loss, and the module's ``seq_layout``
under context parallelism; the pipeline runtime reads the shapes of the tensors passed between
stages from ``bound.unit_shapes(inputs)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from chipset.errors import ConfigError
from chipset.parallel.split import balanced_runs, read_counts

__all__ = ["UnitSpec", "UnitStageModel", "chain_problems", "parse_unit_split", "split_units", "unit_names"]


@dataclass(frozen=True)
class UnitSpec:
    """What one virtual stage holds: pipeline units ``[first, last)`` and their names."""

    virtual_stage: int
    first: int
    last: int
    names: tuple[str, ...]

    def describe(self) -> str:
        span = f"unit {self.first}" if self.last - self.first == 1 else f"units {self.first}-{self.last - 1}"
        return f"{span} ({', '.join(self.names)})"


def unit_names(bound) -> list[str]:
    """The qualified names of ``bound.pipeline_units()`` in ``bound.module``."""
    names = {id(m): n for n, m in bound.module.named_modules()}
    out = []
    for i, unit in enumerate(bound.pipeline_units()):
        name = names.get(id(unit))
        if not name:
            raise ConfigError(f"pipeline unit {i} ({type(unit).__name__}) is not a submodule of the model; "
                              "pipeline_units must return the model's own submodules (not the model itself)")
        out.append(name)
    if len(set(out)) != len(out):
        raise ConfigError(f"pipeline units repeat a module ({', '.join(out)}); each unit must appear once")
    return out


def parse_unit_split(text: str, parts: int, units: int) -> list[int]:
    """``"2,3"`` -> [2, 3]: units per virtual stage, ``parts`` entries of at least 1 summing to ``units``."""
    counts, problems = read_counts(text, parts, "unit")
    if sum(counts) != units:
        problems.append(f"sums to {sum(counts)} units, expected the model's {units} pipeline units")
    if any(c < 1 for c in counts):
        problems.append("gives a virtual stage no unit (every stage needs at least one)")
    if problems:
        raise ConfigError(f"parallel.pipeline_split = {text!r} " + "; ".join(problems))
    return counts


def split_units(bound, parts: int, explicit: str = "") -> list[UnitSpec]:
    """One :class:`UnitSpec` per virtual stage of the pipeline units of ``bound`` (a model bound
    to its family)."""
    names = unit_names(bound)
    units = bound.pipeline_units()
    if explicit:
        counts = bound.pipeline_counts(explicit, parts)
    else:
        if parts > len(units):
            raise ConfigError(f"pp*virtual_stages ({parts}) exceeds the model's {len(units)} pipeline units "
                              f"({', '.join(names)}); use fewer stages")
        counts = balanced_runs([sum(p.numel() for p in u.parameters()) for u in units], parts)
    specs, first = [], 0
    for s, c in enumerate(counts):
        specs.append(UnitSpec(s, first, first + c, tuple(names[first:first + c])))
        first += c
    return specs


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``name`` in ``root``, creating empty parents."""
    *parents, leaf = name.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


class UnitStageModel(nn.Module):
    """The pipeline units one rank holds, under their single-process names.

    What the runtime calls: ``chunk_forward(c, x)`` runs chunk ``c`` (token ids or inputs in on
    the first virtual stage, outputs of the last unit out), ``aux_loss(c)`` its units' extra
    loss terms, ``loss`` the family's output loss, ``local`` this rank's share of a sequence
    batch under context parallelism, ``units`` what ZeRO-3 gathers.
    """

    def __init__(self, bound, specs: list[UnitSpec]):
        super().__init__()
        self.specs = specs
        units = bound.pipeline_units()
        self._chunks = [[units[i] for i in range(s.first, s.last)] for s in specs]
        for spec in specs:
            for i, name in zip(range(spec.first, spec.last), spec.names, strict=True):
                _attach(self, name, units[i])
        self._loss = bound.output_loss
        self._aux = bound.aux_loss
        self._layout = getattr(bound.module, "seq_layout", None)  # context parallel: this rank's tokens

    def units(self) -> list[nn.Module]:
        """What ZeRO-3 gathers together, in forward order: this rank's units that hold parameters."""
        return [u for chunk in self._chunks for u in chunk if any(True for _ in u.parameters())]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` (batch, seq): all of them, or its cp share."""
        return t if self._layout is None else self._layout.local(t)

    def chunk_forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        for unit in self._chunks[chunk]:
            x = unit(x)
        return x

    def aux_loss(self, chunk: int) -> torch.Tensor | None:
        """The family's auxiliary loss of chunk ``chunk``'s units after its forward (None: none)."""
        return self._aux(self._chunks[chunk])

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(outputs, targets)


def chain_problems(bound, par) -> list[str]:
    """Why ``bound`` (a model built on the meta device, bound to its family) cannot be cut for
    ``par`` (a :class:`chipset.train.config.ParallelConfig`): checked with the layout before launch."""
    try:
        split_units(bound, par.pp * max(par.virtual_stages, 1), par.pipeline_split)
    except ConfigError as exc:
        return [str(exc)]
    return []
