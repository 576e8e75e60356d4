"""``chipset rl``: GRPO post-training with verifiable rewards; one process, or N ranks through torchrun."""

from __future__ import annotations

import sys
from pathlib import Path

from chipset.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "rl",
        help="reinforcement learning (GRPO) with verifiable rewards: rollouts, rewards, updates (docs/rl.md)",
        description="Post-train a decoder with GRPO: sample rl.group_size completions per prompt (a built-in "
        "task or a JSONL file), score them with reward functions, update the policy on any dp/ZeRO/tp "
        "layout. Config keys: docs/config.md ([rl] and the rest).",
    )
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.toml", help="TOML config file (optional)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key, e.g. --set rl.group_size=8 --set parallel.zero=3")
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, metavar="N",
                   help="ranks on this node (default 1)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where to write config.toml, metrics.jsonl, summary.json, checkpoints (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="auto|none|PATH",
                   help="as chipset train: auto continues from the newest complete checkpoint of --run-dir")
    p.add_argument("--discard-checkpoints", action="store_true",
                   help="delete another run's checkpoints found in --run-dir before starting")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the whole job up to N times when a rank dies; it resumes from the last checkpoint")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.cli.train import adopt_run
    from chipset.loader import backend
    from chipset.rl.loop import check
    from chipset.rl.rewards import resolve_rewards
    from chipset.rl.tasks import prompt_source
    from chipset.train.checkpoint.launcher import check_resume
    from chipset.train.config import parse_overrides, resolve_config, to_toml
    from chipset.train.launch import default_run_dir
    from chipset.train.rundir import (
        RunLock,
        atomic_write_text,
        finished_message,
        finished_step,
        read_run_id,
    )

    if args.nproc < 1 or args.max_restarts < 0:
        raise UsageError(f"--nproc ({args.nproc}) must be >= 1 and --max-restarts ({args.max_restarts}) >= 0")
    parse_overrides(args.overrides)
    b = backend()
    cfg = resolve_config(args.config, args.overrides, world_size=args.nproc, dtypes=b.capabilities.dtypes)
    check(cfg, args.nproc)
    source = prompt_source(cfg.rl, cfg.data.seed)  # a bad prompt file or reward name: exit 2 before launch
    resolve_rewards(cfg.rl.rewards, source.reward, cfg.rl.task or "reward")
    if args.nproc > 1 and not b.capabilities.multi_process:
        raise UsageError(f"backend {b.name!r} does not declare multi_process, so it cannot run {args.nproc} ranks")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    check_resume(run_dir, args.resume, cfg, b, read_run_id(run_dir) if args.resume == "auto" else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir, shared=False):
        if args.resume == "auto" and (done := finished_step(run_dir, cfg.train.steps)) is not None:
            print(finished_message(run_dir, done), flush=True)
            return 0
        adopt_run(run_dir, args.resume, discard=args.discard_checkpoints)
        config_path = run_dir / "config.toml"
        atomic_write_text(config_path, to_toml(cfg))
        print(f"chipset rl: run directory {run_dir}", flush=True)
        return _launch(args, b, run_dir, config_path)


def _launch(args, b, run_dir: Path, config_path: Path) -> int:
    from chipset.train import signals
    from chipset.train.checkpoint.launcher import report_failure
    from chipset.train.launch import launch, torchrun_command

    if args.nproc == 1 and args.max_restarts == 0:
        from chipset.rl.worker import run_rank

        try:
            return run_rank(str(config_path), str(run_dir), resume=args.resume)
        except signals.Interrupted as exc:
            print(signals.resume_hint(exc), file=sys.stderr, flush=True)
            return exc.exit_code
    cmd = torchrun_command(config_path, run_dir, nproc=args.nproc, max_restarts=args.max_restarts,
                           resume=args.resume, module="chipset.rl.worker")
    signals.take_stop(run_dir)
    rc = launch(cmd, b.name)
    if rc != 0:
        print(f"chipset rl: torchrun exited with status {rc}; see the rank output above", flush=True)
        report_failure(run_dir)
    return rc
