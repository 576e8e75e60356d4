"""Launching a training job: resolve the backend once, then start every rank with torchrun."""

from __future__ import annotations

import datetime as _dt
import errno
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

__all__ = ["default_run_dir", "torchrun_command", "rendezvous_conf", "launch", "JOB_TMPDIR_ENV"]

JOB_TMPDIR_ENV = "CHIPSET_JOB_TMPDIR"
"""A private folder (mode 0700) every rank of a ``chipset train`` job shares; removed when the job ends."""


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
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None, rdzv_conf: str = "",
                     local_addr: str | None = None,
                     max_restarts: int = 0, resume: str = "none",
                     module: str = "chipset.train.worker") -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line that starts the ranks.

    ``nnodes`` may be an elastic range ``"MIN:MAX"``; ``max_restarts`` is torch's elastic
    agent's restart budget; ``resume`` is handed to every rank (``--resume``). Multi-node
    jobs use the c10d rendezvous at ``rdzv_endpoint`` under the job id ``rdzv_id``, with
    ``rdzv_conf`` (see :func:`rendezvous_conf`); ``local_addr`` is the address the other
    nodes reach this one at. ``module``: the per-rank entry point (``chipset rl``: chipset.rl.worker).
    """
    cmd = [sys.executable, "-m", "chipset.train.agent", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if single_node(nnodes, rdzv_endpoint):
        cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1",
                f"--rdzv-id={rdzv_id or uuid.uuid4().hex}"]
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint or 'localhost:29500'}"]
        if rdzv_id:
            cmd.append(f"--rdzv-id={rdzv_id}")
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    cmd += ["-m", module, "--config", str(config_path), "--run-dir", str(run_dir),
            "--resume", resume]
    return cmd


def single_node(nnodes: int | str, rdzv_endpoint: str | None) -> bool:
    """A job on this machine alone: its stores listen on loopback (chipset.train.agent)."""
    return str(nnodes) == "1" and rdzv_endpoint is None


def launch_env(cmd: list[str], backend_name: str) -> dict[str, str]:
    """The environment the agent and the ranks start with."""
    env = dict(os.environ)
    env["CHIPSET_BACKEND"] = backend_name
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONSAFEPATH"] = "1"  # Python >= 3.11: no current directory on the ranks' import path
    if "--rdzv-endpoint=127.0.0.1:0" in cmd:
        env["CHIPSET_STORES_LOOPBACK"] = "1"
    return env


def rendezvous_conf(endpoint: str | None, conf: str = "") -> str:
    """``--rdzv-conf`` for torchrun: the user's ``KEY=VALUE,...`` plus ``is_host`` where chipset knows it.

    torch guesses whether this node hosts the c10d rendezvous store by comparing the
    endpoint with the machine's hostname and its addresses. A node in its own network
    namespace (or with several interfaces) guesses wrong: no node hosts the store and
    every node waits. So for an endpoint that is not loopback, this node hosts exactly
    when it can bind the endpoint's address and port. Loopback endpoints, and a local
    address whose port is taken already, keep torch's guess, which lets several agents on
    one host settle who hosts.
    """
    items = [c.strip() for c in conf.split(",") if c.strip()]
    if endpoint is None or any(c.split("=", 1)[0].strip() == "is_host" for c in items):
        return ",".join(items)
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        host, port = endpoint, "29400"  # torch's default c10d rendezvous port
    host = host.strip("[]")
    if not host or host == "localhost" or _is_loopback(host) or not port.isdigit():
        return ",".join(items)
    local = _bind_result(host, int(port))
    if local is not None:
        items.append(f"is_host={'true' if local else 'false'}")
    return ",".join(items)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_result(host: str, port: int) -> bool | None:
    """True: this machine can listen at ``host:port``; False: ``host`` is not one of its
    addresses; None: it is, but the port is taken (perhaps by another agent that hosts)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    busy = False
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(addr)
            except OSError as exc:
                busy = busy or exc.errno == errno.EADDRINUSE
                continue
            return True
    return None if busy else False


def launch(cmd: list[str], backend_name: str) -> int:
    """Run the torchrun command with ``CHIPSET_BACKEND`` pinned to the resolved backend."""
    env = launch_env(cmd, backend_name)
    # A private scratch folder for the job's ranks (e.g. the simulator's fault markers):
    # unpredictable, mode 0700, removed when the job ends, whatever way it ends.
    scratch = tempfile.mkdtemp(prefix="chipset-job-")
    env[JOB_TMPDIR_ENV] = scratch
    from chipset.train.signals import run_forwarding

    try:
        rc, signum = run_forwarding(cmd, env)  # SIGINT/SIGTERM go to the ranks (train/signals.py)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 128 + signum if signum else rc
