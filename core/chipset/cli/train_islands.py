"""``chipset train`` for a job split into islands (``islands.count > 1``; docs/islands.md)."""

from __future__ import annotations

from pathlib import Path

from chipset.errors import UsageError


def island_world(args, count: int) -> int:
    """The job's world size: ``--nproc`` ranks per island with ``--island``, else split over the islands."""
    return args.nproc * count if args.island is not None else args.nproc


def check_island_args(args, cfg, min_nodes: int, max_nodes: int) -> list[int]:
    """The islands this command runs; UsageError (exit 2) for a command line islands cannot use."""
    count = cfg.islands.count
    if max_nodes != 1 or min_nodes != 1:
        raise UsageError(f"--nnodes {args.nnodes} with islands.count = {count}: an island runs on one node; start one "
                         "command per island with --island I (and islands.endpoint), e.g. one per node")
    if args.island is not None and not 0 <= args.island < count:
        raise UsageError(f"--island {args.island}: expected an island index from 0 to {count - 1} (islands.count = {count})")
    if args.print_schedule:
        raise UsageError("--print-schedule with islands: print the schedule of one island's layout without "
                         "islands.count (the islands do not change it)")
    return [args.island] if args.island is not None else list(range(count))


def island_backends(cfg, here: list[int], default) -> dict[int, object]:
    """Each island's backend (``islands.backends``, else this command's), loaded and checked: it must
    run ``cfg``'s dtype and, with several ranks per island, declare multi_process."""
    from chipset.loader import backend
    from chipset.train.islands.config import island_backends as names_of

    names = names_of(cfg.islands)
    out = {}
    for i in here:
        b = backend(names[i]) if names else default
        if cfg.train.dtype not in b.capabilities.dtypes:
            raise UsageError(f"island {i} runs on backend {b.name!r}, which does not support train.dtype = "
                             f"{cfg.train.dtype!r} (it supports {', '.join(b.capabilities.dtypes)}); choose a dtype "
                             "every island's backend supports")
        out[i] = b
    return out


def run_islands(args, cfg, default_backend, run_dir: Path, family, *, preflight, adopt_run, project) -> int:
    """Check everything an island would trip over, write the run directory and start the islands
    (``preflight``, ``adopt_run``, ``project``: cli/train.py's, passed in to keep one import direction)."""
    from chipset.train.config import to_toml
    from chipset.train.islands.launch import island_dir, launch_islands
    from chipset.train.rundir import RunLock, atomic_write_text

    here = check_island_args(args, cfg, *_nodes(args))
    from chipset.errors import ConfigError
    from chipset.train.config import client_data_path_problems

    unreadable = client_data_path_problems(cfg, here)  # the data of the clients this command runs
    if unreadable:
        raise ConfigError("\n".join(unreadable))
    per_island = args.nproc if args.island is not None else args.nproc // cfg.islands.count
    backends = island_backends(cfg, here, default_backend)
    for i, b in backends.items():
        if per_island > 1 and not b.capabilities.multi_process:
            raise UsageError(f"island {i}: backend {b.name!r} does not declare multi_process, so it cannot run "
                             f"{per_island} ranks; use one rank per island")
        if per_island > b.device.device_count():
            raise UsageError(f"island {i}: {per_island} rank(s) exceed the {b.device.device_count()} device(s) "
                             f"backend {b.name!r} sees on this node")
        preflight(cfg, b, run_dir, per_island, per_island, family)
    run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir, shared=args.island is not None):
        for i in here:
            island_dir(run_dir, i).mkdir(parents=True, exist_ok=True)
            adopt_run(island_dir(run_dir, i), args.resume, discard=args.discard_checkpoints)
        config_path = run_dir / "config.toml"
        atomic_write_text(config_path, to_toml(cfg))
        print(f"chipset train: run directory {run_dir}, {_mode(cfg.islands)}", flush=True)
        names = [backends[i].name if i in backends else "" for i in range(cfg.islands.count)]
        rc = launch_islands(cfg, islands_here=here, backends=names, nproc=per_island, run_dir=run_dir,
                            config_path=config_path, resume=args.resume, max_restarts=args.max_restarts)
    if rc == 0 and args.project:
        from chipset.planner.islands import island_view

        # one island's work: its ranks and its 1/count of the global batch
        rc = project(args.project, island_view(cfg), per_island, island_dir(run_dir, here[0]))
        if rc == 0:
            project_islands(args, cfg, per_island, run_dir, island_dir(run_dir, here[0]))
    return rc


def project_islands(args, cfg, per_island: int, run_dir: Path, island0: Path) -> dict | None:
    """The outer step on the profile (planner/islands.py), from island ``island0``'s projected inner
    step: printed and written to ``RUN_DIR/summary.json`` as ``projection`` with its ``islands`` terms."""
    import json

    from chipset.planner.islands import default_link, format_islands, islands_for_config
    from chipset.planner.projection import resolve_profile
    from chipset.train.rundir import atomic_write_text, strict_dumps

    try:
        proj = json.loads((island0 / "summary.json").read_text())["projection"]
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError, KeyError):
        print(f"chipset train: no islands projection on this node: {island0} has no projected summary.json")
        return None
    dev = resolve_profile(args.project, cfg.train.dtype)
    link, source = default_link(dev, per_island, args.inter_island_bw, args.outer_target)
    terms = islands_for_config(cfg, per_island, dev, link, proj["step_time_s"])
    terms["inter_island_bw_source"] = source
    summary["projection"] = {**proj, "islands": terms}
    atomic_write_text(run_dir / "summary.json", strict_dumps(summary, indent=2) + "\n")
    for line in format_islands(terms):
        print(line, flush=True)
    return terms


def _nodes(args) -> tuple[int, int]:
    from chipset.train.checkpoint.launcher import parse_nnodes

    return parse_nnodes(args.nnodes)


def _mode(isl) -> str:
    from chipset.train.islands.config import federated

    if not federated(isl):
        overlap = ", its exchange overlapped with the next steps (delayed)" if isl.overlap == "delayed" else ""
        return f"{isl.count} islands (DiLoCo, an outer step every {isl.sync_every} steps{overlap})"
    extras = [x for x, on in (("secure aggregation", isl.secure_aggregation),
                              (f"DP noise {isl.noise_multiplier} x clip {isl.clip_norm}", isl.noise_multiplier > 0)) if on]
    return f"{isl.count} federated clients (a round every {isl.sync_every} steps; {', '.join(extras)})"
