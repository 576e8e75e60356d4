"""Keeping the global batch when an elastic job runs on fewer nodes than it was planned for.

``chipset train --nnodes MIN:MAX`` resolves the config for the largest world of the
range, so the run directory's ``config.toml`` holds that world's dp and micro_batches.
When torch's elastic agent forms the job with fewer nodes (a node was lost for good and
the survivors re-rendezvoused), every rank calls :func:`fit_world` before building
anything: dp follows the world, and ``parallel.micro_batches`` rises so that each
micro-batch keeps its size (sequences per micro-batch, hence activation memory per rank)
and ``dp x micro_batches x size`` is still ``train.global_batch``. The data stream and
the loss mean do not depend on that split (data/datasets.py), so the losses stay those of
the planned layout.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass

from chipset.errors import ConfigError

__all__ = ["WorldChange", "fit_world", "check_node_range"]


@dataclass(frozen=True)
class WorldChange:
    """The planned world and the one the job actually runs on (``summary.json`` key ``elastic``)."""

    planned_world_size: int
    world_size: int
    planned_nodes: int
    nodes: int
    planned_dp: int
    dp: int
    planned_micro_batches: int
    micro_batches: int
    global_batch: int
    micro_batch_size: int
    """Sequences per micro-batch per rank: the same before and after."""

    def line(self) -> str:
        """The one log line rank 0 prints."""
        return (f"chipset elastic: running on {self.nodes} of {self.planned_nodes} planned node(s): "
                f"world {self.planned_world_size} -> {self.world_size}, dp {self.planned_dp} -> {self.dp}, "
                f"micro_batches {self.planned_micro_batches} -> {self.micro_batches} "
                f"(train.global_batch {self.global_batch} kept, {self.micro_batch_size} sequences per micro-batch)")

    def to_dict(self) -> dict:
        return asdict(self)


def fit_world(cfg, world_size: int, *, local_world_size: int | None = None) -> WorldChange | None:
    """Adapt ``cfg.parallel`` (in place) to ``world_size`` ranks; None when it already fits.

    ``cfg`` is the config as the launcher resolved it (``parallel.dp`` set). Raises
    ConfigError (exit 2) when the global batch cannot be kept on this world.
    """
    par, tr = cfg.parallel, cfg.train
    other = par.tp * par.pp * par.cp
    if par.dp <= 0 or par.dp * other == world_size:
        return None
    planned_world = par.dp * other
    if world_size % other:
        raise ConfigError(
            f"the job re-formed with {world_size} rank(s), which tp*pp*cp ({other}) does not divide; "
            f"the config was resolved for {planned_world}. Use a node range whose every node count gives a "
            "multiple of tp*pp*cp ranks, or lower tp/pp/cp"
        )
    dp = world_size // other
    size = tr.global_batch // (par.dp * par.micro_batches)
    if size < 1 or tr.global_batch % (dp * size):
        raise ConfigError(
            f"train.global_batch ({tr.global_batch}) cannot be kept on a world of {world_size} rank(s): "
            f"dp {dp} x micro-batches of {size} sequence(s) (the size planned for dp {par.dp} x micro_batches "
            f"{par.micro_batches}) is {dp * size}, which does not divide {tr.global_batch}. Choose "
            f"train.global_batch divisible by {dp * size}, or a node range without that node count"
        )
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
    change = WorldChange(
        planned_world_size=planned_world, world_size=world_size,
        planned_nodes=max(1, planned_world // local), nodes=max(1, world_size // local),
        planned_dp=par.dp, dp=dp, planned_micro_batches=par.micro_batches,
        micro_batches=tr.global_batch // (dp * size), global_batch=tr.global_batch, micro_batch_size=size,
    )
    par.dp, par.micro_batches = change.dp, change.micro_batches
    return change


def check_node_range(cfg, nproc: int, min_nodes: int, max_nodes: int,
                     dtypes: tuple[str, ...] | None = None) -> None:
    """Before launch: every node count of ``MIN:MAX`` must keep the global batch and validate.

    ``cfg`` is resolved for ``max_nodes``; it is not changed. ConfigError (exit 2) names
    the first node count that does not work.
    """
    from chipset.train.config import validate

    for nodes in range(max_nodes - 1, min_nodes - 1, -1):
        trial = copy.deepcopy(cfg)
        world = nproc * nodes
        try:
            fit_world(trial, world, local_world_size=nproc)
        except ConfigError as exc:
            raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: on {nodes} node(s) {exc}") from None
        problems = validate(trial, world, dtypes)
        if problems:
            raise ConfigError(
                f"--nnodes {min_nodes}:{max_nodes}: on {nodes} node(s) ({world} ranks, dp {trial.parallel.dp}, "
                f"micro_batches {trial.parallel.micro_batches}) the config would not be valid: "
                + "; ".join(problems)
            )
