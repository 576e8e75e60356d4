"""The per-rank entry point: ``python -m chipset.train.worker --config C --run-dir D``.

torchrun starts one of these per rank. The launcher has already resolved the backend and
put its name in ``CHIPSET_BACKEND``, so every rank loads the same one.
"""

from __future__ import annotations

import os
import sys

# ``python -m`` put the current directory first on the import path; a module lying there
# (say typing_extensions.py) must not run inside a rank. (Python >= 3.11 ranks start with
# PYTHONSAFEPATH=1 from the launcher, so this only matters on 3.10.) Under safe_path nothing
# was put there: sys.path[0] is then the first PYTHONPATH entry, which may well be the current
# directory on purpose (``PYTHONPATH=. chipset train`` with model.family = "my_model:family").
if (not getattr(sys.flags, "safe_path", False) and sys.path
        and os.path.abspath(sys.path[0] or ".") == os.getcwd()):
    del sys.path[0]

import argparse  # noqa: E402
import traceback  # noqa: E402

from chipset.errors import ChipsetError, CollectiveError

__all__ = ["run_rank", "main"]


def run_rank(config_path: str, run_dir: str | None, resume: str = "none") -> int:
    """Train this rank. Also how ``chipset train`` runs a one-rank job inside its own process:
    signal handlers, environment and device state are the caller's again afterwards."""
    from chipset.train import signals
    from chipset.train.rank import restored_environ

    # SIGINT/SIGTERM: stop at the end of a step on every rank (train/signals.py)
    with signals.installed(), restored_environ():
        return _run_rank(config_path, run_dir, resume)


def _run_rank(config_path: str, run_dir: str | None, resume: str) -> int:
    from chipset.train.config import load_config, resolve_dtype
    from chipset.train.elastic import fit_world
    from chipset.train.islands.clients import client_config
    from chipset.train.islands.link import island_index
    from chipset.train.loop import train
    from chipset.train.rank import start, stop

    cfg = client_config(load_config(config_path), island_index())  # islands.client_data: this island's data.path
    if run_dir is not None:  # a backend's native flight recorder dumps here on a timeout (hangs.py)
        from chipset.interfaces.collective import FLIGHT_RECORDER_ENV
        from chipset.train.checkpoint.hangs import flight_dir

        os.environ.setdefault(FLIGHT_RECORDER_ENV, str(flight_dir(run_dir)))
    b = start()  # the backend the launcher chose (CHIPSET_BACKEND), its device, the process group
    try:
        # An elastic job re-formed on fewer nodes: same global batch, more micro-batches.
        change = fit_world(cfg, b.collective.world_size())
        resolve_dtype(cfg, b.capabilities.default_dtype)  # a config written by hand with "auto"
        # In an islands job this world is one island; the config speaks of the whole job.
        islands = cfg.islands.count if island_index() is not None else 1
        cfg.validate(world_size=b.collective.world_size() * islands, dtypes=b.capabilities.dtypes)
        try:
            train(cfg, b, run_dir, resume=resume, elastic=change)
        except CollectiveError as exc:
            if run_dir is not None:  # what this rank last did, for the launcher's hang report
                from chipset.train.checkpoint.hangs import write_rank_log

                write_rank_log(run_dir, b.collective, exc)
            raise
    finally:
        stop(b)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chipset.train.worker")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", default="none", help="auto, none or a checkpoint path (docs/fault-tolerance.md)")
    from chipset.train import signals

    signals.install()
    signals.die_with_parent()  # a SIGKILLed torchrun agent takes its ranks with it
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    from chipset.logs import configure

    configure(rank)  # library log lines of this rank carry "[rank N]"
    try:
        return run_rank(args.config, args.run_dir, args.resume)
    except signals.Interrupted as exc:  # every rank stopped together; the launcher reports it
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
