"""``chipset train``: train the reference model; one process, or N ranks through torchrun."""

from __future__ import annotations

from pathlib import Path

from chipset.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train the reference transformer (default config: a tiny model for a few steps)",
        description="Train the reference decoder-only transformer. With no arguments a tiny model "
        "trains for 20 steps on the selected backend. Config keys: docs/config.md.",
    )
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.toml", help="TOML config file (optional)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key, e.g. --set train.steps=20 --set parallel.zero=3")
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, metavar="N",
                   help="ranks on this node (default 1)")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="nodes in the job, or an elastic range MIN:MAX: the job keeps running on as few as MIN "
                   "nodes, with train.global_batch kept by more micro-batches (passed to torchrun)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (passed to torchrun)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="c10d rendezvous endpoint for multi-node jobs, the same on every node; the node that "
                   "owns HOST hosts it (passed to torchrun)")
    p.add_argument("--rdzv-id", default=None, metavar="ID",
                   help="job id, the same on every node of one job (passed to torchrun)")
    p.add_argument("--local-addr", default=None, metavar="ADDR",
                   help="this node's address as the other nodes reach it (default: what the hostname resolves "
                   "to; set it where that is a loopback address) (passed to torchrun)")
    p.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...",
                   help="torch rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2 "
                   "(passed to torchrun)")
    p.add_argument("--run-dir", default=None, metavar="DIR", help="where to write config.toml, metrics.jsonl, "
                   "summary.json (default runs/<timestamp>)")
    p.add_argument("--profile-steps", default=None, metavar="FIRST:LAST",
                   help="record a torch.profiler Chrome trace of steps FIRST..LAST (1-based) per rank into "
                   "RUN_DIR/traces (same as --set train.profile_steps=FIRST:LAST)")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto (default): continue from the run directory's newest complete checkpoint, if any; "
                   "none: start fresh; PATH: a checkpoint folder or another run directory (docs/fault-tolerance.md)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the whole job up to N times when a rank dies (torch's elastic agent); "
                   "it resumes from the last checkpoint")
    p.add_argument("--project", default=None, metavar="PROFILE",
                   help="after the run, report the step time the same work would take on the named device profile "
                   "(chipset plan --list-profiles), from the FLOPs and collective bytes of the run, through the "
                   "planner's cost model; written to summary.json as 'projection' (docs/planner.md)")
    p.add_argument("--print-schedule", action="store_true",
                   help="with parallel.pp > 1: print the stage split and the checked pipeline schedule (per-rank "
                   "timeline and instructions), then exit without training")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.config import parse_overrides, resolve_config, to_toml
    from chipset.engine.checkpoint.launcher import (
        check_resume,
        clear_hang_logs,
        parse_nnodes,
        report_failure,
    )
    from chipset.engine.elastic import check_node_range
    from chipset.engine.launch import default_run_dir, launch, rendezvous_conf, torchrun_command
    from chipset.loader import backend

    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.nproc < 1 or args.max_restarts < 0:
        raise UsageError(f"--nproc ({args.nproc}) must be >= 1 and --max-restarts ({args.max_restarts}) >= 0")
    world = args.nproc * max_nodes
    if args.profile_steps is not None:
        args.overrides = [*args.overrides, f'train.profile_steps="{args.profile_steps}"']
    parse_overrides(args.overrides)  # malformed --set items fail before the backend is loaded
    # Resolve the backend once, here; every rank gets its name.
    b = backend()
    cfg = resolve_config(args.config, args.overrides, world_size=world, dtypes=b.capabilities.dtypes)
    if args.project is not None:  # an unknown profile: exit 2 before anything is written
        from chipset.planner.projection import resolve_profile

        resolve_profile(args.project, cfg.train.dtype)
    if args.print_schedule:
        return _print_schedule(cfg, b)
    if min_nodes < max_nodes:  # every smaller world must keep the global batch: refuse now, not mid-job
        check_node_range(cfg, args.nproc, min_nodes, max_nodes, dtypes=b.capabilities.dtypes)
    if world > 1 and not b.capabilities.multi_process:
        raise UsageError(
            f"backend {b.name!r} does not declare multi_process, so it cannot run {world} ranks; "
            "use --nproc 1 or choose another backend with CHIPSET_BACKEND"
        )
    if args.nproc > b.device.device_count():
        raise UsageError(
            f"--nproc ({args.nproc}) exceeds the {b.device.device_count()} device(s) backend {b.name!r} "
            f"sees on this node; lower --nproc or make more devices visible ({b.device.visible_devices_env})"
        )
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    _preflight(cfg, b, run_dir, world, args.nproc)  # bad folder, data, timeout or sizes: exit 2, nothing written
    check_resume(run_dir, args.resume, cfg, b)  # a bad --resume or a different model: exit 2, nothing written
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    config_path.write_text(to_toml(cfg))
    print(f"chipset train: run directory {run_dir}")
    if world == 1 and args.max_restarts == 0:
        from chipset.engine.worker import run_rank

        rc = run_rank(str(config_path), str(run_dir), resume=args.resume)
        return _project(args.project, cfg, world, run_dir) if rc == 0 and args.project else rc
    nnodes = str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
    cmd = torchrun_command(config_path, run_dir, nproc=args.nproc, nnodes=nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, local_addr=args.local_addr,
                           rdzv_conf=rendezvous_conf(args.rdzv_endpoint, args.rdzv_conf),
                           max_restarts=args.max_restarts, resume=args.resume)
    clear_hang_logs(run_dir)
    rc = launch(cmd, b.name)
    if rc != 0:
        print(f"chipset train: torchrun exited with status {rc}; see the rank output above", flush=True)
        report_failure(run_dir)
    elif args.project:
        return _project(args.project, cfg, world, run_dir)
    return rc


def _preflight(cfg, b, run_dir: Path, world: int, local_ranks: int) -> None:
    """What would otherwise fail inside every rank (or after the run directory exists): check it here.

    The run directory must be a writable folder, ``data.path`` must exist, ``CHIPSET_COLLECTIVE_TIMEOUT``
    must parse, and the planner's per-rank memory estimate must fit the backend's devices (and the
    host's available memory where the devices are host memory), so absurd sizes exit 2 in seconds.
    """
    from chipset.errors import ConfigError
    from chipset.interfaces.collective import collective_timeout
    from chipset.preflight import check_job_memory, check_writable_dir

    check_writable_dir(run_dir, "run directory", "--run-dir")
    if cfg.data.source == "text" and cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path = {cfg.data.path!r}: no such file or directory; give a text file or a "
                          "folder of them (or leave data.path empty for the Python standard library's sources)")
    collective_timeout()
    caps = b.capabilities
    total = b.device.properties(0).total_memory if caps.memory_capacity_enforced else None
    check_job_memory(cfg, world, local_ranks, total, b.device.torch_device(0).type == "cpu",
                     kernels="fused" if caps.kernels else "reference")


def _project(profile: str, cfg, world: int, run_dir: Path) -> int:
    """Add the projection onto ``profile`` to summary.json and print it (the run's last step's counts)."""
    import json

    from chipset.planner.projection import format_projection, project

    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not (summary_path.exists() and metrics_path.exists()):  # written by the node that runs rank 0
        print(f"chipset train: no projection on this node: {run_dir} has no summary.json (rank 0's node reports it)")
        return 0
    last = json.loads(metrics_path.read_text().splitlines()[-1])
    summary = json.loads(summary_path.read_text())
    # The world that really ran (an elastic job may have run on fewer nodes than planned).
    world = int(summary.get("world_size", world))
    cfg.parallel.dp = int(summary.get("layout", {}).get("dp", cfg.parallel.dp))
    proj = project(cfg, world, last.get("comm", {}), profile)
    summary["projection"] = proj
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_projection(proj, last.get("step_time_s"), summary.get("tokens_per_s")), flush=True)
    return 0


def _print_schedule(cfg, b) -> int:
    if cfg.parallel.pp < 2:
        raise UsageError("--print-schedule needs a pipeline: set parallel.pp >= 2 (e.g. --set parallel.pp=2 --nproc 2)")
    from chipset.engine.pipeline import describe_pipeline

    print(describe_pipeline(cfg, b.kernels))
    return 0
