"""Launching a training job: resolve the backend once, then start every rank with torchrun."""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["default_run_dir", "torchrun_command", "launch"]


def default_run_dir(root: str | Path = "runs") -> Path:
    """``runs/<UTC timestamp>``, with a numeric suffix if that exists already."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / stamp
    path, i = base, 1
    while path.exists():
        path = Path(f"{base}-{i}")
        i += 1
    return path


def torchrun_command(config_path: Path, run_dir: Path, *, nproc: int, nnodes: int | str = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, max_restarts: int = 0, resume: str = "none") -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line that starts the ranks.

    ``nnodes`` may be an elastic range ``"MIN:MAX"``; ``max_restarts`` is torch's elastic
    agent's restart budget; ``resume`` is handed to every rank (``--resume``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint or 'localhost:29500'}"]
    cmd += ["-m", "chipset.engine.worker", "--config", str(config_path), "--run-dir", str(run_dir),
            "--resume", resume]
    return cmd


def launch(cmd: list[str], backend_name: str) -> int:
    """Run the torchrun command with ``CHIPSET_BACKEND`` pinned to the resolved backend."""
    env = dict(os.environ)
    env["CHIPSET_BACKEND"] = backend_name
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env)
    return proc.returncode
