"""``chipset train``: train the reference model; one process, or N ranks through torchrun."""

from __future__ import annotations

import signal
import sys
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
    p.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="auto|none|PATH",
                   help="auto (default; also a bare --resume): continue from the run directory's newest complete "
                   "checkpoint, if any, or report that its run already finished; none: start fresh; PATH: a "
                   "checkpoint folder or another run directory (docs/fault-tolerance.md)")
    p.add_argument("--discard-checkpoints", action="store_true",
                   help="delete checkpoints of an earlier run found in --run-dir before starting a new run there "
                   "(without it, chipset refuses to start a new run over them; docs/fault-tolerance.md)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the whole job up to N times when a rank dies (torch's elastic agent); "
                   "it resumes from the last checkpoint")
    p.add_argument("--project", default=None, metavar="PROFILE",
                   help="after the run, report the step time the same work would take on the named device profile "
                   "(chipset plan --list-profiles), from the FLOPs and collective bytes of the run, through the "
                   "planner's cost model; written to summary.json as 'projection' (docs/planner.md)")
    p.add_argument("--inter-island-bw", type=float, default=None, metavar="GBps",
                   help="with --project on an islands job (islands.count > 1): GB/s of each island's link to the "
                   "others, for the outer step's time, the break-even islands.sync_every and the comparison with "
                   "plain dp (default: the profile's inter-node bandwidth per device x ranks per island; "
                   "docs/islands.md)")
    p.add_argument("--outer-target", type=float, default=None, metavar="FRACTION",
                   help="with --project on an islands job: the largest share of the time outer steps may take, "
                   "for the break-even islands.sync_every (default 0.05)")
    p.add_argument("--island", type=int, default=None, metavar="I",
                   help="with islands.count > 1: run only island I here, on --nproc ranks (one command per island, "
                   "e.g. per node with its own CHIPSET_BACKEND; islands.endpoint names where they meet); without "
                   "it every island runs here, --nproc split evenly (docs/islands.md)")
    p.add_argument("--print-schedule", action="store_true",
                   help="with parallel.pp > 1: print the stage split and the checked pipeline schedule (per-rank "
                   "timeline and instructions), then exit without training")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.loader import backend
    from chipset.parallel.fp8 import check_fp8
    from chipset.train.checkpoint.launcher import check_resume, parse_nnodes
    from chipset.train.config import parse_overrides, resolve_config, to_toml
    from chipset.train.elastic import check_node_range
    from chipset.train.launch import default_run_dir
    from chipset.train.rundir import (
        RunLock,
        atomic_write_text,
        finished_message,
        finished_step,
        read_run_id,
    )

    if args.resume.endswith(".toml") and args.config is None and Path(args.resume).is_file():
        raise UsageError(f"--resume {args.resume}: that is a config file, not a checkpoint (a bare --resume takes "
                         f"the next word as its value); put the config first: chipset train {args.resume} --resume")
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.nproc < 1 or args.max_restarts < 0:
        raise UsageError(f"--nproc ({args.nproc}) must be >= 1 and --max-restarts ({args.max_restarts}) >= 0")
    world = args.nproc * max_nodes
    if args.profile_steps is not None:
        args.overrides = [*args.overrides, f'train.profile_steps="{args.profile_steps}"']
    parse_overrides(args.overrides)  # malformed --set items fail before the backend is loaded
    if args.island is not None:  # one island of a job split over several commands: --nproc ranks per island
        from chipset.cli.train_islands import island_world
        from chipset.train.config import load_config

        world = island_world(args, max(1, load_config(args.config, args.overrides).islands.count))
    # Resolve the backend once, here; every rank gets its name.
    b = backend()
    cfg = resolve_config(args.config, args.overrides, world_size=world, dtypes=b.capabilities.dtypes,
                         default_dtype=b.capabilities.default_dtype)
    family = _check_family(cfg)  # an unknown family or a layout it does not support: exit 2 now
    check_fp8(cfg.train.fp8, b)  # FP8 on a backend that does not declare it: exit 2 now
    if args.island is not None and cfg.islands.count < 2:
        raise UsageError(f"--island {args.island} needs islands.count >= 2 (found {cfg.islands.count})")
    if args.project is not None:  # an unknown profile: exit 2 before anything is written
        from chipset.planner.projection import resolve_profile

        resolve_profile(args.project, cfg.train.dtype)
    _check_islands_projection(args, cfg)
    if cfg.islands.count > 1:  # islands: each its own world and backend (cli/train_islands.py)
        from chipset.cli.train_islands import run_islands

        return run_islands(args, cfg, b, Path(args.run_dir) if args.run_dir else default_run_dir(), family,
                           preflight=_preflight, adopt_run=adopt_run, project=_project)
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
    _preflight(cfg, b, run_dir, world, args.nproc, family)  # bad folder, data, timeout or sizes: exit 2, nothing written
    # A bad --resume, a different model or an incompatible config: exit 2, nothing written.
    check_resume(run_dir, args.resume, cfg, b, read_run_id(run_dir) if args.resume == "auto" else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    # One job per run directory; the nodes of one multi-node job share it.
    single_node = str(args.nnodes) == "1" and args.rdzv_endpoint is None
    with RunLock(run_dir, shared=not single_node):
        if args.resume == "auto" and (done := finished_step(run_dir, cfg.train.steps)) is not None:
            print(finished_message(run_dir, done), flush=True)  # exit 0: rerunning a finished command is fine
            return 0
        adopt_run(run_dir, args.resume, discard=args.discard_checkpoints)
        config_path = run_dir / "config.toml"
        atomic_write_text(config_path, to_toml(cfg))
        print(f"chipset train: run directory {run_dir}")
        return _launch(args, cfg, b, world, min_nodes, max_nodes, run_dir, config_path)


def _launch(args, cfg, b, world, min_nodes, max_nodes, run_dir: Path, config_path: Path) -> int:
    from chipset.train import signals
    from chipset.train.checkpoint.launcher import clear_hang_logs, report_failure
    from chipset.train.launch import launch, rendezvous_conf, torchrun_command

    if world == 1 and args.max_restarts == 0:
        from chipset.train.worker import run_rank

        try:
            rc = run_rank(str(config_path), str(run_dir), resume=args.resume)
        except signals.Interrupted as exc:
            print(signals.resume_hint(exc), file=sys.stderr, flush=True)
            return exc.exit_code
        return _project(args.project, cfg, world, run_dir) if rc == 0 and args.project else rc
    nnodes = str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
    cmd = torchrun_command(config_path, run_dir, nproc=args.nproc, nnodes=nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, local_addr=args.local_addr,
                           rdzv_conf=rendezvous_conf(args.rdzv_endpoint, args.rdzv_conf),
                           max_restarts=args.max_restarts, resume=args.resume)
    clear_hang_logs(run_dir)
    signals.take_stop(run_dir)  # a stale one from an earlier job
    rc = launch(cmd, b.name)
    stop = signals.take_stop(run_dir)
    if stop is not None or rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        print(signals.resume_hint(stop, rc - 128), file=sys.stderr, flush=True)
        return stop.exit_code if stop is not None else rc
    if rc != 0:
        print(f"chipset train: torchrun exited with status {rc}; see the rank output above", flush=True)
        report_failure(run_dir)
    elif args.project:
        return _project(args.project, cfg, world, run_dir)
    return rc


def _check_family(cfg):
    """The model family of ``cfg``; ConfigError (exit 2) when it cannot run this layout."""
    from chipset.errors import ConfigError
    from chipset.models.family import layout_problems
    from chipset.models.registry import resolve_family

    family = resolve_family(cfg.model.family)
    problems = layout_problems(family, cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    if getattr(family, "config_class", None) is not None:  # the run's config.toml holds every key, defaults too
        import dataclasses

        cfg.model.family_options = dataclasses.asdict(family.options(cfg))
    return family


def _preflight(cfg, b, run_dir: Path, world: int, local_ranks: int, family=None) -> None:
    """What would otherwise fail inside every rank (or after the run directory exists): check it here.

    The run directory must be a writable folder, the optional packages the config needs must import,
    ``data.path`` must exist, ``CHIPSET_COLLECTIVE_TIMEOUT``
    must parse, and the planner's per-rank memory estimate must fit the backend's devices (and the
    host's available memory where the devices are host memory), so absurd sizes exit 2 in seconds.
    """
    from chipset.errors import ConfigError
    from chipset.interfaces.collective import collective_timeout
    from chipset.parallel.compile import check_compile
    from chipset.planner.run import check_job_memory
    from chipset.preflight import check_optional_packages, check_writable_dir

    check_writable_dir(run_dir, "run directory", "--run-dir")
    check_optional_packages(cfg)  # e.g. init_from without safetensors: exit 2 here, not a traceback per rank
    from chipset.train.sinks import check_metrics_sinks

    check_metrics_sinks(cfg)  # a sink named in train.metrics_sinks whose package is missing: exit 2 here
    if cfg.data.source == "text" and cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path = {cfg.data.path!r}: no such file or directory; give a text file or a "
                          "folder of them (or leave data.path empty for the Python standard library's sources)")
    if cfg.data.source == "hf" and not cfg.data.streaming:  # tokenize once here, so the ranks only read the cache
        from chipset.data.hf import ensure_prepared

        ensure_prepared(cfg.data.path, cfg.data.tokenizer, cfg.data.field)
    collective_timeout()
    check_compile(cfg.train.compile, b.name, b.record.descriptor)
    if family is not None and not getattr(family, "described_by_planner", False):
        return  # the planner's memory model describes the decoder-only transformer only
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
    from chipset.train.rundir import atomic_write_text, strict_dumps

    atomic_write_text(summary_path, strict_dumps(summary, indent=2) + "\n")
    print(format_projection(proj, last.get("step_time_s"), summary.get("tokens_per_s"),
                            backend=summary.get("backend", "?")), flush=True)
    return 0


def _check_islands_projection(args, cfg) -> None:
    """``--inter-island-bw`` / ``--outer-target``: only with ``--project`` on an islands job, and sane
    (ConfigError, exit 2, before anything is written)."""
    given = [f for f, v in (("--inter-island-bw", args.inter_island_bw), ("--outer-target", args.outer_target))
             if v is not None]
    if given and not (args.project and cfg.islands.count > 1):
        raise UsageError(f"{' and '.join(given)} describe(s) the outer step of an islands job: use with --project "
                         f"PROFILE and islands.count >= 2 (found islands.count = {cfg.islands.count}"
                         f"{'' if args.project else ', no --project'})")
    if args.project and cfg.islands.count > 1:  # a bad or missing bandwidth, a bad target: refused now
        from chipset.planner.islands import default_link
        from chipset.planner.projection import resolve_profile

        default_link(resolve_profile(args.project, cfg.train.dtype), 1, args.inter_island_bw, args.outer_target)


def _print_schedule(cfg, b) -> int:
    if cfg.parallel.pp < 2:
        raise UsageError("--print-schedule needs a pipeline: set parallel.pp >= 2 (e.g. --set parallel.pp=2 --nproc 2)")
    from chipset.models.family import bind, meta_model
    from chipset.models.registry import resolve_family
    from chipset.runtime.pipeline import describe_pipeline

    family = resolve_family(cfg.model.family)
    print(describe_pipeline(cfg, bind(family, meta_model(family, cfg, b.kernels), cfg)))
    return 0


def adopt_run(run_dir: Path, mode: str, *, discard: bool = False) -> str:
    """Decide this job's run id (call holding the run directory's lock); returns it.

    ``--resume auto`` (and a restart) continues the run recorded in ``run.json``;
    ``--resume none`` starts a new run. Checkpoints of any other run (or from before run
    ids) would be mistaken for the new run's, and a new run's save of the same step would
    replace them: refused (exit 2) unless ``discard``, which deletes them first.
    ``--resume PATH`` keeps the recorded run (a new one if none) and leaves checkpoints alone.
    """
    import shutil

    from chipset.train.checkpoint import store
    from chipset.train.rundir import new_run_id, read_run_id, write_run_id

    current = read_run_id(run_dir) if mode != "none" else None
    if mode in ("auto", "none"):
        other = [c for c in store.list_checkpoints(run_dir)
                 if current is None or store.run_id_of(c.path) != current]
        if other and not discard:
            ids = sorted({store.run_id_of(c.path) or "written before run ids" for c in other})
            steps = ", ".join(str(c.step) for c in sorted(other, key=lambda c: c.step))
            why = ("--resume none starts a new run" if mode == "none"
                   else "this run directory's run.json names no run they belong to")
            raise UsageError(
                f"run directory {run_dir} holds {len(other)} checkpoint(s) of another run (run {', '.join(ids)}; "
                f"steps {steps}) and {why}. Choose another --run-dir, resume one of them with --resume PATH, "
                "or add --discard-checkpoints to delete them and start the new run here")
        for c in other:
            shutil.rmtree(c.path)
            print(f"chipset train: deleted {c.path} (another run's checkpoint; --discard-checkpoints)", flush=True)
    return write_run_id(run_dir, current or new_run_id())
