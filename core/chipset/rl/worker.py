"""The per-rank entry point of ``chipset rl``: ``python -m chipset.rl.worker --config C --run-dir D``.

The same life as a ``chipset train`` rank (chipset.train.worker): signals stop every rank at a
step's end, the backend comes from ``CHIPSET_BACKEND``, a ChipsetError is its exit code (2 for
a configuration or reward error).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from chipset.errors import ChipsetError

__all__ = ["run_rank", "main"]


def run_rank(config_path: str, run_dir: str | None, resume: str = "none") -> int:
    """One RL rank; like chipset.train.worker.run_rank, leaves the caller's process as it found it."""
    from chipset.train import signals
    from chipset.train.rank import restored_environ

    with signals.installed(), restored_environ():
        return _run_rank(config_path, run_dir, resume)


def _run_rank(config_path: str, run_dir: str | None, resume: str) -> int:
    from chipset.rl.loop import run
    from chipset.train.config import load_config
    from chipset.train.rank import start, stop

    cfg = load_config(config_path)
    b = start()
    try:
        cfg.validate(world_size=b.collective.world_size(), dtypes=b.capabilities.dtypes)
        run(cfg, b, run_dir, resume=resume)
    finally:
        stop(b)
    return 0


def main(argv: list[str] | None = None) -> int:
    from chipset.logs import configure
    from chipset.train import signals

    p = argparse.ArgumentParser(prog="python -m chipset.rl.worker")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", default="none")
    signals.install()
    signals.die_with_parent()
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    configure(rank)
    try:
        return run_rank(args.config, args.run_dir, args.resume)
    except signals.Interrupted as exc:
        if rank == "0" and args.run_dir is not None:
            signals.write_stop(args.run_dir, exc)
        return 0
    except ChipsetError as exc:
        print(f"chipset: error (rank {rank}): {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception:
        print(f"chipset: rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    from chipset._process import exit_rank

    exit_rank(main())
