"""ParallelDims: the job's parallel layout, validated once, with process groups built lazily.

Rank order (documented, fixed): ranks are laid out as a row-major grid over
``(pp, dp, cp, tp)`` with tp fastest-varying, so tensor-parallel peers are neighbours
(on one node where possible) and pipeline stages are the slowest dimension::

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

Expert parallelism (ep) is carved out of the data-parallel ranks (``parallel/experts.py``):
with the data index ``d = dp_idx * cp + cp_idx``, ``ep_idx = d % ep`` (ep fastest, so
expert-parallel peers are neighbours) and ``edp_idx = d // ep``. Dimension ``"ep"`` groups
the ranks that differ only in ``ep_idx`` (tokens move between them by all-to-all);
``"edp"`` (expert-data-parallel, ``dp*cp/ep`` ranks) those that differ only in
``edp_idx``: they hold the same experts and reduce their gradients together.
Groups are created through ``backend.collective.new_group`` the first time they are
asked for; every rank must ask for them in the same order (collective creation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from chipset.errors import ConfigError
from chipset.interfaces import Collective, Group

__all__ = ["ParallelDims"]

_ORDER = ("pp", "dp", "cp", "tp")


@dataclass
class ParallelDims:
    """Degrees of every parallel dimension and the ZeRO stage of one job."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    world_size: int = 1
    _groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp", "tp", "pp", "cp", "ep", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name} ({v!r}) must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            problems.append(f"zero ({self.zero!r}) must be a ZeRO stage 0, 1, 2 or 3")
        if not problems:
            prod = self.dp * self.tp * self.pp * self.cp
            if prod != self.world_size:
                problems.append(f"dp*tp*pp*cp ({prod}) must equal world size ({self.world_size})")
            if (self.dp * self.cp) % self.ep:
                problems.append(f"ep ({self.ep}) must divide dp*cp ({self.dp * self.cp})")
        if problems:
            raise ConfigError("invalid parallel layout: " + "; ".join(problems))

    # --- flags ---------------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks holding the same experts (``dp*cp/ep``)."""
        return self.dp * self.cp // self.ep

    def layout(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "zero": self.zero}

    # --- coordinates -----------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension."""
        sizes = self._sizes()
        out = {}
        for name in reversed(_ORDER):
            out[name] = rank % sizes[name]
            rank //= sizes[name]
        return out

    def rank_of(self, **coords: int) -> int:
        sizes = self._sizes()
        r = 0
        for name in _ORDER:
            r = r * sizes[name] + coords.get(name, 0)
        return r

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of dimension ``dim``: lists of global ranks that differ only along ``dim``.

        ``dim`` may join several dimensions with ``_`` (``"dp_cp"``): ranks that differ only
        along those, in rank order.
        """
        if dim in ("ep", "edp"):
            return self._expert_group_ranks(dim)
        names = dim.split("_")
        if any(n not in _ORDER for n in names):
            raise ValueError(f"unknown dimension {dim!r}; expected one of {', '.join(_ORDER)} (or several joined by _)")
        sizes = self._sizes()
        inner = [n for n in _ORDER if n in names]
        others = [n for n in _ORDER if n not in names]
        out = []
        for idx in product(*(range(sizes[n]) for n in others)):
            fixed = dict(zip(others, idx, strict=True))
            out.append([self.rank_of(**fixed, **dict(zip(inner, j, strict=True)))
                        for j in product(*(range(sizes[n]) for n in inner))])
        return out

    def _expert_group_ranks(self, dim: str) -> list[list[int]]:
        """Groups of ``"ep"`` or ``"edp"`` (module docstring: data index d, ep_idx = d % ep)."""
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            d = c["dp"] * self.cp + c["cp"]
            key = (c["pp"], c["tp"], d // self.ep if dim == "ep" else d % self.ep)
            out.setdefault(key, []).append(rank)
        return list(out.values())

    def dp_replicas(self) -> list[list[int]]:
        """Lists of ranks that hold the same parameters, bit for bit: they differ only along dp
        and, under expert parallelism, hold the same experts (a list of one: a rank no other
        rank replicates). What ``chipset diagnose`` compares ``param_sum`` within (train/model_stats.py)."""
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            ep_idx = (c["dp"] * self.cp + c["cp"]) % self.ep  # experts differ between ep ranks (module docstring)
            out.setdefault((c["pp"], c["tp"], c["cp"], ep_idx), []).append(rank)
        return list(out.values())

    # --- groups (lazy) ----------------------------------------------------------
    def group(self, dim: str, collective: Collective) -> Group:
        """This rank's group along ``dim``, created on first use (every rank must call this together)."""
        if dim in self._groups:
            return self._groups[dim]
        me = collective.rank()
        mine = None
        span = 1
        for n in dim.split("_"):
            span *= self._sizes().get(n, 1)
        if self.world_size == 1 or span == self.world_size:
            mine = collective.world
        else:
            # new_group is collective over the world: every rank creates every group.
            for ranks in self.group_ranks(dim):
                g = collective.new_group(ranks, name=f"{dim}{ranks}")
                if me in ranks:
                    mine = g
        assert mine is not None
        self._groups[dim] = mine
        return mine

    def dp_group(self, collective: Collective) -> Group:
        return self.group("dp", collective)

    def replica_group(self, collective: Collective) -> Group:
        """Ranks holding replicas of this rank's parameters: dp x cp (context-parallel ranks see
        different tokens of the same sequences, so they average gradients like dp ranks).
        The dp group itself when cp is 1."""
        return self.group("dp_cp", collective) if self.cp_enabled else self.dp_group(collective)
