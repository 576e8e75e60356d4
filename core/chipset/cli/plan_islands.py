"""``chipset plan`` for an islands job: the cluster is one island; the outer step's terms for the
best layout (planner/islands.py, docs/islands.md "Planning islands")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from chipset.errors import ConfigError

_KEYS = ("count", "sync_every", "pseudo_grad_dtype", "outer_optimizer", "secure_aggregation", "overlap")
"""The [islands] keys the outer step's cost depends on."""


def add_arguments(p) -> None:
    p.add_argument("--islands", type=int, default=None, metavar="N",
                   help="plan an islands job (DiLoCo): N islands, each running the planned layout on the "
                        "--cluster; the global batch is split over them (default: the config's islands.count)")
    p.add_argument("--sync-every", type=int, default=None, metavar="H",
                   help="with islands: inner steps between outer steps (default: the config's islands.sync_every)")
    p.add_argument("--pseudo-grad-dtype", default=None, choices=("fp32", "bf16", "int8"),
                   help="with islands: how pseudo-gradients cross (default: the config's islands.pseudo_grad_dtype)")
    p.add_argument("--overlap", default=None, choices=("off", "delayed"),
                   help="with islands: off (the outer step blocks) or delayed (the exchange runs beside the next H "
                        "inner steps) (default: the config's islands.overlap)")
    p.add_argument("--inter-island-bw", type=float, default=None, metavar="GBps",
                   help="with islands: GB/s of each island's link to the others (default: the profile's "
                        "inter-node bandwidth per device x devices per island)")
    p.add_argument("--outer-target", type=float, default=None, metavar="FRACTION",
                   help="with islands: the largest share of the time outer steps may take, for the break-even "
                        "H (default 0.05)")


def settings(args):
    """The ``[islands]`` table to plan (the config's, flags over it), or None for a job without islands;
    ConfigError (exit 2) for bad values."""
    from chipset.planner.islands import DEFAULT_TARGET, LinkSpec
    from chipset.train.islands.config import IslandsConfig, island_problems

    table = {}
    if args.model and Path(args.model).suffix == ".toml":
        from chipset.cli.plan_config import _source_tables

        table = {k: v for k, v in (_source_tables(Path(args.model).expanduser()).get("islands") or {}).items()
                 if k in _KEYS}
    for key, value in (("count", args.islands), ("sync_every", args.sync_every),
                       ("pseudo_grad_dtype", args.pseudo_grad_dtype), ("overlap", args.overlap)):
        if value is not None:
            table[key] = value
    isl = IslandsConfig(**table)
    extra = [f for f, v in (("--sync-every", args.sync_every), ("--pseudo-grad-dtype", args.pseudo_grad_dtype),
                            ("--overlap", args.overlap),
                            ("--inter-island-bw", args.inter_island_bw), ("--outer-target", args.outer_target))
             if v is not None]
    problems = island_problems(isl, None, 0, 0, 0)
    if isl.count < 2 and extra and not problems:
        problems.append(f"{', '.join(extra)} describe(s) islands, but islands.count = {isl.count}: "
                        "give --islands N (N >= 2) or a config with islands.count >= 2")
    if problems:
        raise ConfigError("islands: " + "; ".join(problems))
    if isl.count < 2:
        return None
    LinkSpec(1.0 if args.inter_island_bw is None else args.inter_island_bw * 1e9, 0.0,
             DEFAULT_TARGET if args.outer_target is None else args.outer_target).check()
    return isl


def island_train(train, isl):
    """The planner's step of one island: ``1/count`` of the global batch."""
    if train.global_batch % isl.count:
        raise ConfigError(f"global batch {train.global_batch} is not divisible by {isl.count} islands: each island "
                          "takes an equal share; choose a multiple of the island count")
    return dataclasses.replace(train, global_batch=train.global_batch // isl.count)


def terms(args, best, model, train, cluster, isl) -> dict:
    """The islands terms (planner/islands.py) of the planner's best layout ``best`` on one island
    (``cluster``), with ``inter_island_bw_source`` saying where the bandwidth came from."""
    from chipset.planner.islands import default_link, islands_terms

    link, source = default_link(cluster.device, cluster.world_size, args.inter_island_bw, args.outer_target)
    out = islands_terms(model, best.layout, train, cluster.device, isl, link, best.step_time_s, best.micro_batches)
    return {**out, "inter_island_bw_source": source}


def report(t: dict) -> list[str]:
    """The lines ``chipset plan`` prints for :func:`terms`."""
    from chipset.planner.islands import format_islands

    return [f"islands: {t['islands']} of this cluster each; inter-island bandwidth: {t['inter_island_bw_source']}",
            *format_islands(t, prefix="chipset plan")]
