"""Start and stop one rank: the backend, its device and the process group.

What every rank does before it builds a model, whether torchrun started it for
``chipset train`` (train/worker.py) or for a user's own script (chipset.api).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["start", "stop", "restored_environ"]

log = logging.getLogger(__name__)


def start(name: str | None = None):
    """Load the backend (``name``, else ``CHIPSET_BACKEND``, else the best available), apply its
    launch environment for this local rank, select the device ``LOCAL_RANK`` and join the process
    group (``RANK``/``WORLD_SIZE`` from the launcher; a single process without one gets a world of
    one). Returns the :class:`chipset.loader.Backend`."""
    from chipset.loader import backend

    b = backend(name)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The launch_env of the backend's spec (e.g. visible devices) for this local rank, applied
    # before the rank touches a device.
    os.environ.update(b.launch_env(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    b.device.set_device(local_rank)
    b.collective.init_process_group()
    log.info("rank %d of %d on backend %s", b.collective.rank(), b.collective.world_size(), b.name)
    return b


def stop(b) -> None:
    """Leave the process group and release the device (both idempotent)."""
    try:
        b.collective.destroy()
    finally:
        b.device.release()


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """The block may set environment variables (the backend's launch environment, the flight
    recorder's folder); afterwards the process has the environment it had before. A run inside
    the caller's process must not point the next run's hang dumps at this run's directory."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
