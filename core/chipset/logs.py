"""Logging for chipset's library code: the ``chipset`` logger, with the rank in every line.

Library modules log through ``logging.getLogger(__name__)`` (all under ``chipset``), so a
user's own logging configuration controls them like any other library. The command line
(``chipset ...`` and each rank of a job) calls :func:`configure` once: one stderr handler on
the ``chipset`` logger, level from ``CHIPSET_LOG_LEVEL`` (default ``INFO``; ``DEBUG``,
``WARNING``, ``ERROR`` also accepted), lines prefixed with the rank when there is one::

    [rank 1] WARNING chipset.train.checkpoint: ...

Code that embeds chipset and configures logging itself need not call it.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure(rank: int | str | None = None) -> logging.Logger:
    logger = logging.getLogger("chipset")
    level = os.environ.get("CHIPSET_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level if level in LEVELS else "INFO")
    for h in list(logger.handlers):
        if getattr(h, "_chipset", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._chipset = True
    prefix = f"[rank {rank}] " if rank is not None else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
