"""The Collective interface: a thin, accountable layer over torch.distributed.

Every public op goes through :meth:`Collective._run`, the single place where a backend
adds accounting, fault injection or error translation. Timeouts become
:class:`chipset.CollectiveTimeoutError` instead of a hang.
"""

from __future__ import annotations

import collections
import datetime as _dt
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from chipset.errors import CollectiveError, CollectiveTimeoutError, ConfigError
from chipset.interfaces.device import Device

__all__ = ["Collective", "CommStats", "Group", "Handle", "OpCounter", "P2POp", "REDUCE_OPS", "FLIGHT_RECORDER_ENV", "collective_timeout", "divide_for_avg_",
           "flight_recorder_file"]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

_TIMEOUT_MARKERS = ("timed out", "timeout", "deadline")

# torch 2.13 renamed the single-tensor collectives (the old names warn); older releases lack the new ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
RECENT_OPS = 64
"""How many recent collectives :attr:`Collective.recent_ops` keeps per rank."""


FLIGHT_RECORDER_ENV = "CHIPSET_FLIGHT_RECORDER_DIR"
"""Set by ``chipset train`` on every rank (``RUN_DIR/hangs/flight``): where a backend's native
flight recorder (NCCL's, HCCL's) should dump its ring of recent collectives on a timeout. A
backend turns its recorder on in its spec's ``launch_env``; the launcher's hang report
lists the dumps (train/checkpoint/hangs.py)."""


def flight_recorder_file(prefix: str, environ=None) -> str | None:
    """The dump-file prefix a flight recorder should use (``DIR/PREFIX_rank_``; the library
    appends the rank), or None when no run directory asked for one. Creates DIR."""
    environ = os.environ if environ is None else environ
    d = environ.get(FLIGHT_RECORDER_ENV)
    if not d:
        return None
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{prefix}_rank_")


def collective_timeout() -> _dt.timedelta:
    """The collective timeout: ``CHIPSET_COLLECTIVE_TIMEOUT`` seconds, default 600."""
    raw = os.environ.get("CHIPSET_COLLECTIVE_TIMEOUT", "600")
    try:
        seconds = float(raw)
        if not 0 < seconds < 10**9:  # also refuses nan and inf, which timedelta cannot hold
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"CHIPSET_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds (below 1e9), found {raw!r}; "
            "set it to e.g. 600 or unset it for the default"
        ) from None
    return _dt.timedelta(seconds=seconds)


@dataclass(frozen=True)
class Group:
    """A process group: its global ranks and the torch ProcessGroup (None = world)."""

    ranks: tuple[int, ...]
    pg: Any = None
    name: str = "world"

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class P2POp:
    """One point-to-point transfer for :meth:`Collective.batch_p2p`."""

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    """Global rank of the other side."""
    group: Group | None = None


@dataclass
class OpCounter:
    """Accounting of one collective op type on this rank."""

    calls: int = 0
    bytes: int = 0
    """Bytes of the tensors handed to the op (inputs; for send/recv the buffer), summed over calls."""
    seconds: float = 0.0
    """Seconds the caller was blocked: the call itself plus, for async ops, ``Handle.wait()``."""

    def add_seconds(self, seconds: float) -> None:
        self.seconds += seconds


class CommStats:
    """Per-op-type counters of one Collective (``Collective.comm_stats``); cumulative since creation."""

    def __init__(self) -> None:
        self.ops: dict[str, OpCounter] = {}

    def counter(self, op: str) -> OpCounter:
        c = self.ops.get(op)
        if c is None:
            c = self.ops[op] = OpCounter()
        return c

    def snapshot(self) -> dict[str, tuple[int, int, float]]:
        """``{op: (calls, bytes, seconds)}``: subtract two snapshots to account a window."""
        return {op: (c.calls, c.bytes, c.seconds) for op, c in self.ops.items()}

    def reset(self) -> None:
        self.ops.clear()


class Handle:
    """An in-flight async collective; ``wait()`` raises chipset errors on failure.

    A handle whose ``wait()`` returned is complete, whatever the work object says: gloo's
    asynchronous reduce_scatter never reports completion after ``wait()`` on torch 2.13, and
    a backend inheriting the gloo ops must not have to patch around it.
    """

    _account: Callable[[float], None] | None = None
    _waited = False

    def __init__(self, work: Any, describe: str, translate: Callable[[BaseException, str], BaseException],
                 account: Callable[[float], None] | None = None):
        self._work = work
        self._describe = describe
        self._translate = translate
        self._account = account  # gets the seconds wait() blocked: the op's exposed time

    def wait(self) -> None:
        """Block until the op has completed (a ``chipset::wait`` range while a torch profiler records:
        time blocked in a collective, as the op's own range is)."""
        if self._work is None:
            return
        t0 = time.perf_counter()
        try:
            if torch.autograd.profiler._is_profiler_enabled:
                with torch.profiler.record_function("chipset::wait"):
                    self._work.wait()
            else:
                self._work.wait()
        except Exception as exc:
            raise _past_timeout(self._translate(exc, self._describe), time.perf_counter() - t0) from exc
        finally:
            if self._account is not None:
                self._account(time.perf_counter() - t0)
        self._waited = True

    def is_completed(self) -> bool:
        return self._work is None or self._waited or self._work.is_completed()


class _FinishingHandle(Handle):
    """An async op whose result needs one more local step (an emulated op's division) after ``wait``."""

    def __init__(self, inner: Handle, then: Callable[[], object]):
        super().__init__(None, inner._describe, inner._translate)
        self._inner, self._then, self._done = inner, then, False

    def wait(self) -> None:
        self._inner.wait()
        if not self._done:
            self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


def divide_for_avg_(tensor: torch.Tensor, n: int) -> None:
    """Turn a sum over ``n`` ranks into their average in place; integer tensors truncate toward
    zero (``torch.div(..., rounding_mode="trunc")``), what a float average cast back gives for
    non-negative values."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


class Collective:
    """Collectives of one backend. A backend sets ``c10d_backend`` and may override ``_run``."""

    backend_name: str = ""
    c10d_backend: str = ""
    """torch.distributed backend name used for process groups (e.g. ``"gloo"``)."""

    def __init__(self, device: Device):
        self.device = device
        self._world: Group | None = None

    # --- process groups ----------------------------------------------------------
    def init_process_group(
        self,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: _dt.timedelta | None = None,
    ) -> Group:
        """Join the job's default process group.

        Rank and world size default to the launcher's ``RANK``/``WORLD_SIZE``; a single
        process without a launcher gets a private world of one.
        """
        if dist.is_initialized():
            self._world = Group(tuple(range(dist.get_world_size())), None, "world")
            return self._world
        timeout = timeout or collective_timeout()
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if "MASTER_ADDR" in os.environ or world_size > 1:
            store = _restart_store(world_size, timeout)
            if store is not None:
                dist.init_process_group(self.c10d_backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            else:
                dist.init_process_group(self.c10d_backend, rank=rank, world_size=world_size, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(self.c10d_backend, store=store, rank=0, world_size=1, timeout=timeout)
        self._world = Group(tuple(range(world_size)), None, "world")
        return self._world

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def destroy(self) -> None:
        """Leave the process group (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._world = None

    @property
    def world(self) -> Group:
        if self._world is None:
            if not dist.is_initialized():
                raise CollectiveError("collectives used before init_process_group(); call it first")
            self._world = Group(tuple(range(dist.get_world_size())), None, "world")
        return self._world

    def rank(self, group: Group | None = None) -> int:
        """This process's rank within ``group`` (default: world)."""
        return dist.get_rank(group.pg if group else None)

    def world_size(self, group: Group | None = None) -> int:
        return (group or self.world).size

    def new_group(self, ranks: Sequence[int], name: str = "") -> Group:
        """Create a subgroup. Every process must call this with the same ranks, in the same order."""
        ranks = tuple(int(r) for r in ranks)
        pg = dist.new_group(list(ranks), backend=self.c10d_backend, timeout=collective_timeout())
        return Group(ranks, pg, name or f"group{list(ranks)}")

    def notify_step(self, step: int) -> None:
        """The engine calls this at the start of every training step (0-based).

        Backends may use it (the simulator's fault injection counts steps); default: nothing.
        """

    # The two hooks below let a backend inject input faults where the training loop measures
    # them. They live here, next to notify_step, because the collective is the per-rank object
    # the loop already tells about each step (and where the simulator keeps its fault plan).
    def notify_batch(self, step: int) -> None:
        """The training loop calls this while it fetches step ``step``'s batches (0-based), inside
        the time it records as this rank's wait for its data (``data_wait_s``, docs/diagnose.md).

        Backends may use it (the simulator's ``slow_loader`` fault sleeps here); default: nothing.
        """

    def notify_compute(self, step: int) -> None:
        """The training loop calls this on the host once step ``step``'s batches are fetched, just
        before its forward (0-based): inside the step's compute time and its ``chipset::step``
        profiler range, outside every operator.

        Backends may use it (the simulator's ``host_delay`` fault sleeps here: host overhead
        between kernels, for ``chipset diagnose`` to find in a trace); default: nothing.
        """

    def loss_factor(self, step: int) -> float:
        """What the engine multiplies step ``step``'s loss by before backward, so the recorded loss
        and the gradients both carry it. Default 1.0; the simulator's ``loss_spike`` fault raises it
        at one step (a bad batch, for ``chipset diagnose`` to find)."""
        return 1.0

    @staticmethod
    def finish_after(handle: Handle | None, then: Callable[[], object]) -> Handle | None:
        """Run ``then`` once the op has completed: at once for a synchronous op (``handle`` is
        None), on the first ``wait()`` of an async one. For ops a backend emulates, e.g. an
        ``avg`` its library lacks, done as a sum then :func:`divide_for_avg_`."""
        if handle is None:
            then()
            return None
        return _FinishingHandle(handle, then)

    # --- ops -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Group | None = None, async_op: bool = False):
        """Reduce ``tensor`` in place across ``group``."""
        rop = _reduce_op(op)
        g = group or self.world
        return self._run("all_reduce", g, [tensor], lambda: dist.all_reduce(tensor, rop, group=g.pg, async_op=async_op), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None, async_op: bool = False):
        """Concatenate every rank's ``input`` along dim 0 into ``output`` (size * input rows)."""
        g = group or self.world
        _expect_numel(output, input.numel() * g.size, "all_gather output")
        return self._run("all_gather", g, [input], lambda: _all_gather_single(output, input, group=g.pg, async_op=async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", group: Group | None = None, async_op: bool = False):
        """Reduce ``input`` across ranks and leave rank i's 1/size slice (dim 0) in ``output``."""
        rop = _reduce_op(op)
        g = group or self.world
        _expect_numel(input, output.numel() * g.size, "reduce_scatter input")
        return self._run("reduce_scatter", g, [input], lambda: _reduce_scatter_single(output, input, rop, group=g.pg, async_op=async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None, async_op: bool = False):
        """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
        g = group or self.world
        return self._run("broadcast", g, [tensor], lambda: dist.broadcast(tensor, src, group=g.pg, async_op=async_op), async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group: Group | None = None,
        async_op: bool = False,
    ):
        """Scatter slices of ``input`` (dim 0, optionally uneven) to every rank; gather theirs into ``output``."""
        g = group or self.world
        osz = list(output_split_sizes) if output_split_sizes is not None else None
        isz = list(input_split_sizes) if input_split_sizes is not None else None
        return self._run(
            "all_to_all", g, [input],
            lambda: dist.all_to_all_single(output, input, osz, isz, group=g.pg, async_op=async_op),
            async_op,
        )

    def send(self, tensor: torch.Tensor, dst: int, group: Group | None = None) -> None:
        """Send ``tensor`` to global rank ``dst`` (blocking)."""
        g = group or self.world
        self._run("send", g, [tensor], lambda: dist.send(tensor, dst, group=g.pg), False)

    def recv(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
        """Receive into ``tensor`` from global rank ``src`` (blocking)."""
        g = group or self.world
        self._run("recv", g, [tensor], lambda: dist.recv(tensor, src, group=g.pg), False)

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Launch sends and receives together; wait on every returned handle."""
        if not ops:
            return []
        tops = [
            dist.P2POp(dist.isend if o.op == "send" else dist.irecv, o.tensor, o.peer, group=o.group.pg if o.group else None)
            for o in ops
        ]
        g = ops[0].group or self.world

        def launch():
            return dist.batch_isend_irecv(tops)

        works = self._run("batch_p2p", g, [o.tensor for o in ops], launch, True, raw=True)
        account = self.comm_stats.counter("batch_p2p").add_seconds  # waits count as blocked time
        return [Handle(w, f"batch_p2p[{i}]", self._translate, account=account) for i, w in enumerate(works)]

    def barrier(self, group: Group | None = None) -> None:
        """Block until every rank of ``group`` has reached the barrier."""
        g = group or self.world
        self._run("barrier", g, [], lambda: dist.barrier(group=g.pg), False)

    # --- the single choke point ----------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        """Calls, bytes and blocking seconds per op type, counted by :meth:`_run` on every backend."""
        stats = self.__dict__.get("_comm_stats")
        if stats is None:  # created lazily: subclasses need not call our __init__
            stats = self.__dict__["_comm_stats"] = CommStats()
        return stats

    def _run(self, op: str, group: Group, tensors: list[torch.Tensor], fn: Callable[[], Any], async_op: bool, raw: bool = False):
        """Run one collective. Backends override to add accounting or fault injection.

        Counts the op in :attr:`comm_stats` (one dict update and two clock reads, so it is
        always on) and, while a torch profiler is recording, marks it as a
        ``chipset::<op>`` range in the trace.
        """
        describe = f"{op} on {group.name} ({group.size} ranks)"
        counter = self.comm_stats.counter(op)
        counter.calls += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        counter.bytes += nbytes
        entry = self._log_op(op, group, nbytes)
        t0 = time.perf_counter()
        try:
            if torch.autograd.profiler._is_profiler_enabled:
                with torch.profiler.record_function(f"chipset::{op}"):
                    work = fn()
            else:
                work = fn()
        except Exception as exc:
            raise _past_timeout(self._translate(exc, describe), time.perf_counter() - t0) from exc
        finally:
            counter.seconds += time.perf_counter() - t0
        entry["state"] = "launched" if async_op or raw else "done"
        if raw:
            return work
        if async_op:
            return Handle(work, describe, self._translate, account=counter.add_seconds)
        return None

    @property
    def recent_ops(self) -> collections.deque:
        """The last :data:`RECENT_OPS` collectives this rank entered, oldest first (for hang reports).

        Each is a dict: ``op``, ``group`` (name), ``ranks``, ``seq`` (this rank's sequence number
        of ops on that group, from 0), ``bytes``, ``time`` (Unix seconds) and ``state``:
        ``entered`` (still inside, or failed), ``done`` (a blocking op returned) or ``launched``
        (an async op was started).
        """
        log = self.__dict__.get("_recent_ops")
        if log is None:  # created lazily, like comm_stats
            log = self.__dict__["_recent_ops"] = collections.deque(maxlen=RECENT_OPS)
            self.__dict__["_group_seq"] = {}
        return log

    def _log_op(self, op: str, group: Group, nbytes: int) -> dict:
        log = self.recent_ops
        seqs = self.__dict__["_group_seq"]
        seq = seqs.get(group.name, 0)
        seqs[group.name] = seq + 1
        entry = {"op": op, "group": group.name, "ranks": group.ranks, "seq": seq, "bytes": nbytes,
                 "time": time.time(), "state": "entered"}
        log.append(entry)
        return entry

    def _translate(self, exc: BaseException, describe: str) -> BaseException:
        if isinstance(exc, CollectiveError):
            return exc
        text = str(exc)
        if isinstance(exc, TimeoutError) or any(m in text.lower() for m in _TIMEOUT_MARKERS):
            return CollectiveTimeoutError(
                f"{describe} did not complete within the collective timeout "
                f"({collective_timeout().total_seconds():g} s, CHIPSET_COLLECTIVE_TIMEOUT): a peer is "
                f"stalled or dead. Backend said: {text.strip().splitlines()[0] if text.strip() else type(exc).__name__}"
            )
        if isinstance(exc, (RuntimeError, dist.DistError)):
            return CollectiveError(f"{describe} failed: {text.strip().splitlines()[0] if text.strip() else type(exc).__name__}")
        return exc


def _past_timeout(err: BaseException, waited: float) -> BaseException:
    """A plain CollectiveError raised after the op had waited most of the collective timeout is
    a timeout: a hung rank's neighbours see either their own timeout or the connection that a
    peer dropped on its own timeout. That peer entered the op a little earlier or later, so
    the wait is compared with half the limit, not the whole: a peer that died outright drops
    its connections at once, well inside it."""
    limit = collective_timeout().total_seconds()
    if type(err) is CollectiveError and waited >= limit / 2:
        return CollectiveTimeoutError(f"{err} (after {waited:.1f} s, the collective timeout of {limit:g} s, "
                                      "CHIPSET_COLLECTIVE_TIMEOUT: a peer is stalled or dead)")
    return err


def _restart_store(world_size: int, timeout: _dt.timedelta):
    """A fresh key space for a job torchrun's elastic agent restarted, or None.

    After a restart (torch 2.13) the workers get the same agent store as the failed
    attempt, which still holds that attempt's rendezvous keys: a rank could read a dead
    peer's address and fail to connect. A prefix per attempt keeps attempts apart.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"chipset/attempt_{restart}", store)


def _reduce_op(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(REDUCE_OPS)}") from None


def _expect_numel(t: torch.Tensor, numel: int, what: str) -> None:
    if t.numel() != numel:
        raise ValueError(f"{what} must have {numel} elements (world size x input), found {t.numel()}")
