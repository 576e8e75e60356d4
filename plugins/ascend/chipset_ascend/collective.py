"""Collectives over HCCL, with HCCL's own timeouts tied to chipset's collective timeout.

HCCL does not read the ``timeout=`` given to ``init_process_group`` for everything:
link set-up waits ``HCCL_CONNECT_TIMEOUT`` seconds and a collective waits for its
peers ``HCCL_EXEC_TIMEOUT`` seconds, both read from the environment when the
communicator is created. chipset derives both from ``CHIPSET_COLLECTIVE_TIMEOUT``
(default 600 s) so a stalled peer surfaces as chipset's CollectiveTimeoutError after
the one timeout the user set, not after HCCL's defaults (120 s / 1836 s). A value the
user exported for an HCCL variable is left alone: it is the more specific setting.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from collections.abc import Mapping, MutableMapping

from chipset.interfaces import Collective, Group
from chipset.interfaces.collective import collective_timeout, divide_for_avg_

CONNECT_ENV = "HCCL_CONNECT_TIMEOUT"
EXEC_ENV = "HCCL_EXEC_TIMEOUT"
# CANN documents HCCL_CONNECT_TIMEOUT as an integer in [120, 7200] seconds.
CONNECT_RANGE = (120, 7200)
# On Atlas A2 (910B) HCCL_EXEC_TIMEOUT is an integer in [0, 2147483647], 0 = never;
# chipset never asks for "never".
EXEC_RANGE = (1, 2147483647)

# How HCCL and torch_npu's watchdog word a timeout: CANN error codes EI0002 (a notify
# wait "times out" during a collective) and EI0006 (getting a socket "times out" during
# link set-up), and the watchdog's "ran for N milliseconds before timing out". Core's
# markers ("timed out", "timeout") miss these phrasings.
_HCCL_TIMEOUT_MARKERS = ("times out", "timing out", "ei0002", "ei0006")


def hccl_timeout_env(timeout: _dt.timedelta | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """HCCL timeout variables for chipset's collective timeout, minus any the user already set."""
    environ = os.environ if environ is None else environ
    seconds = math.ceil((timeout or collective_timeout()).total_seconds())
    wanted = {
        CONNECT_ENV: min(max(seconds, CONNECT_RANGE[0]), CONNECT_RANGE[1]),
        EXEC_ENV: min(max(seconds, EXEC_RANGE[0]), EXEC_RANGE[1]),
    }
    return {k: str(v) for k, v in wanted.items() if not environ.get(k)}


def apply_hccl_timeouts(environ: MutableMapping[str, str] | None = None, timeout: _dt.timedelta | None = None) -> dict[str, str]:
    """Set the HCCL timeout variables in ``environ`` (default: this process) and return what was set."""
    environ = os.environ if environ is None else environ
    env = hccl_timeout_env(timeout, environ)
    environ.update(env)
    return env


class AscendCollective(Collective):
    backend_name = "ascend"
    c10d_backend = "hccl"

    def init_process_group(self, *, rank: int | None = None, world_size: int | None = None, timeout: _dt.timedelta | None = None) -> Group:
        """Join the default group over HCCL; HCCL's timeouts are set first (they are read at communicator creation)."""
        apply_hccl_timeouts(timeout=timeout)
        return super().init_process_group(rank=rank, world_size=world_size, timeout=timeout)

    # torch_npu's ProcessGroupHCCL maps only SUM, MAX, MIN and PRODUCT to HCCL; AVG is
    # refused there. chipset's "avg" is a SUM followed by a local division by the size.
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if op != "avg":
            return super().all_reduce(tensor, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().all_reduce(tensor, "sum", group, async_op), lambda: divide_for_avg_(tensor, n))

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if op != "avg":
            return super().reduce_scatter(output, input, op, group, async_op)
        n = (group or self.world).size
        return self.finish_after(super().reduce_scatter(output, input, "sum", group, async_op),
                                 lambda: divide_for_avg_(output, n))

    def _translate(self, exc: BaseException, describe: str) -> BaseException:
        text = str(exc).lower()
        if not isinstance(exc, TimeoutError) and any(m in text for m in _HCCL_TIMEOUT_MARKERS):
            # Core words the CollectiveTimeoutError; it only needs to know this was one.
            return super()._translate(TimeoutError(str(exc)), describe)
        return super()._translate(exc, describe)
