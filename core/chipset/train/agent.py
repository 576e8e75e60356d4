"""torchrun's elastic agent, started so that a single-node job exposes nothing to the network.

``python -m chipset.train.agent ARGS`` is ``python -m torch.distributed.run ARGS`` with two
differences:

- **Loopback stores.** With ``CHIPSET_STORES_LOOPBACK=1`` (the launcher sets it for
  single-node jobs) every TCP store the agent hosts (the rendezvous store, which the ranks
  share) listens on 127.0.0.1 only. torch's ``TCPStore`` server otherwise listens on all
  interfaces, whatever address it is given, so any host that can reach the machine could
  join or poison the job. The store is handed a socket already bound to loopback
  (``master_listen_fd``). Multi-node jobs must be reachable from the other nodes and keep
  torch's behaviour (bind the rendezvous to a private interface with ``--rdzv-endpoint``
  and ``--local-addr``; see docs/fault-tolerance.md, "Multi-node").
- **No current directory on the import path.** ``python -m`` puts the current directory
  first on ``sys.path``, so a ``typing_extensions.py`` (or any module name torch imports)
  lying there would run inside the agent. It is removed before torch is imported; the
  launcher also sets ``PYTHONSAFEPATH=1`` (Python >= 3.11) so the ranks start without it.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():  # before anything imports
    del sys.path[0]

import socket  # noqa: E402


def _loopback_store_class(base):
    class LoopbackTCPStore(base):
        """A TCPStore whose server listens on 127.0.0.1 only (clients are unchanged)."""

        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            if is_master and kwargs.get("master_listen_fd") is None and len(args) < 4:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", int(port)))
                sock.listen(1024)
                kwargs["master_listen_fd"] = sock.detach()
                host_name = "127.0.0.1"
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    return LoopbackTCPStore


def main() -> None:
    if os.environ.get("CHIPSET_STORES_LOOPBACK") == "1":
        import torch.distributed as dist

        dist.TCPStore = _loopback_store_class(dist.TCPStore)  # before torch's launcher imports it
    from torch.distributed.run import main as torchrun_main

    torchrun_main()


if __name__ == "__main__":
    from chipset._process import exit_process

    try:
        main()
    except SystemExit as exc:
        exit_process(exc.code)
    exit_process(0)  # a failed worker group raises (torch's traceback and exit 1, as before)
