"""The host-side link between islands: a store to meet at, a quorum per outer step, and gloo
process groups of the islands in it.

Every island is its own job world (its own backend, its own c10d process group), so nothing
an island does inside reaches another island. Between islands there is only this link: rank
``r`` of every island talks to rank ``r`` of the others over a gloo group on host tensors, a
group every backend can join whatever its devices. The groups are built directly on a
``TCPStore`` (``ProcessGroupGloo(store, rank, size)``), not through the default world, so an
island can die and the others form a new group without it.

Quorum (one per outer step, torchft-style): the first rank of each live island announces
itself under the step's key; once every island has (or ``islands.quorum_timeout`` passed),
the first to close the quorum writes the member list, and every island reads that one list.
A member list that changed from the last one gets fresh groups. Bytes and calls crossing
islands are counted in :attr:`IslandLink.stats`, apart from the island's own collectives.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chipset.errors import CollectiveError, ConfigError
from chipset.interfaces.collective import CommStats

__all__ = ["ISLAND_ENV", "STORE_ENV", "REJOIN_ENV", "IslandLink", "Pending", "Quorum", "island_index", "connect_store", "mark_restarting",
           "parse_endpoint"]

log = logging.getLogger(__name__)

ISLAND_ENV = "CHIPSET_ISLAND"
"""Set by the launcher on every rank of island ``i``: its index."""
STORE_ENV = "CHIPSET_ISLANDS_STORE"
"""HOST:PORT of the store the islands meet at (the launcher's, or ``islands.endpoint``)."""
REJOIN_ENV = "CHIPSET_ISLAND_REJOIN"
"""Set by the launcher on an island it restarted: fetch the global state from the live islands."""
HEARTBEAT_S = 1.0
"""Seconds between an island's heartbeats on the store."""
STALE_S = 5.0
"""An island whose heartbeat stood still this long (as a peer observes it) is dead: quorums stop waiting."""


def island_index() -> int | None:
    """This process's island (``CHIPSET_ISLAND``), or None outside an islands job."""
    raw = os.environ.get(ISLAND_ENV, "")
    return int(raw) if raw.strip().isdigit() else None


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"islands store address {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def connect_store(endpoint: str, *, timeout_s: float, host: bool = False) -> dist.TCPStore:
    """The islands' store at ``endpoint``: hosted here (``host``) or reached as a client.
    A store that cannot be reached within ``timeout_s`` is a ConfigError naming it."""
    addr, port = parse_endpoint(endpoint)
    try:
        return dist.TCPStore(addr, port, None, host, timeout=_dt.timedelta(seconds=timeout_s),
                             wait_for_workers=False, use_libuv=False)
    except (RuntimeError, dist.DistError) as exc:
        what = "host" if host else "reach"
        raise ConfigError(f"cannot {what} the islands' store at {endpoint} ({str(exc).strip().splitlines()[0]}); "
                          "check islands.endpoint (HOST:PORT of the node running island 0) and that the islands "
                          "can reach each other there") from None


def mark_restarting(store, island: int, on: bool) -> None:
    """A launcher restarts ``island``: quorums wait for it (up to the quorum timeout) until it is back."""
    if on:
        store.set(f"restarting/{island}", "1")
    else:
        store.delete_key(f"restarting/{island}")


@dataclass(frozen=True)
class Quorum:
    """The islands of one outer step: ``members`` (sorted island indices) and ``joiners`` (those
    that fetch the global state instead of contributing), ``group_id`` names their groups."""

    step: int
    members: tuple[int, ...]
    joiners: tuple[int, ...]
    group_id: int

    @property
    def contributors(self) -> tuple[int, ...]:
        return tuple(m for m in self.members if m not in self.joiners)


class IslandLink:
    """Rank ``local_rank`` of island ``island`` (of ``count``) on the islands' store."""

    def __init__(self, endpoint: str, *, island: int, count: int, local_rank: int, timeout_s: float,
                 quorum_timeout_s: float):
        self.endpoint = endpoint
        self.store = connect_store(endpoint, timeout_s=timeout_s)
        self.island, self.count, self.local_rank = island, count, local_rank
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.quorum_timeout_s = quorum_timeout_s
        self.stats = CommStats()
        """Calls, bytes (of the tensors handed over, as ``Collective.comm_stats`` counts) and seconds
        of everything that crossed between islands from this rank."""
        self._groups: dict[str, tuple] = {}
        self.group = None
        self.quorum: Quorum | None = None
        self.wire_dir = None
        """``islands.wire_log``: a folder that gets a copy of every tensor this rank hands to the link."""
        self._wire_seq = 0

    def clone_store(self):
        """Another client connection to the islands' store (for a thread of its own)."""
        return connect_store(self.endpoint, timeout_s=self.timeout.total_seconds())

    # --- quorum ---------------------------------------------------------------------
    def announce(self, key: str, joiner: bool = False) -> None:
        """This island is at quorum ``key`` (called by the island's first rank only)."""
        self.store.set(f"q/{key}/in/{self.island}", json.dumps({"joiner": joiner}))
        if not joiner and self.store.check([f"restarting/{self.island}"]):
            self.store.delete_key(f"restarting/{self.island}")

    def decide(self, key: str, step: int, serial: int) -> Quorum:
        """Wait for the islands at ``key``, then return the one agreed member list.

        Waited for: every island that is alive, i.e. has not started yet (up to the quorum
        timeout), whose heartbeat moved within :data:`STALE_S`, or that its launcher is
        restarting (not at a retry, which a restarted island never joins); never longer than
        ``islands.quorum_timeout`` (0: no limit)."""
        names = [f"q/{key}/in/{i}" for i in range(self.count)]
        deadline = time.monotonic() + self.quorum_timeout_s if self.quorum_timeout_s else None
        seen: dict[int, tuple[int, float]] = {}  # island -> (heartbeat count, when it last moved)
        while True:
            present = [i for i, n in enumerate(names) if self.store.check([n])]
            if len(present) == self.count or self.store.check([f"q/{key}/members"]):
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if not any(self._alive(i, now, seen, retry=serial % 1000 != 0) for i in range(self.count)
                       if i not in present):
                break
            time.sleep(0.02)
        joiners = [i for i in present if json.loads(self.store.get(names[i]))["joiner"]]
        prev = self.progress()
        # A retry (serial not a multiple of 1000) always gets fresh groups: the old one saw an error.
        same = prev is not None and prev["members"] == present and not joiners and serial % 1000 == 0
        proposal = {"members": present, "joiners": joiners, "step": step,
                    "group_id": prev["group_id"] if same else serial}
        got = json.loads(self.store.compare_set(f"q/{key}/members", "", json.dumps(proposal)).decode())
        if got == proposal:
            self.store.set("q/last", json.dumps(got))
            missing = sorted(set(range(self.count)) - set(present))
            if missing:
                log.warning("islands: the outer step at step %d goes on without island(s) %s", step, missing)
        if not got["members"] or not [m for m in got["members"] if m not in got["joiners"]]:
            raise CollectiveError(f"islands: no island holding the global state reached the outer step at step "
                                  f"{step} (members {got['members']}, joiners {got['joiners']}); the job has lost "
                                  "every live island")
        return Quorum(int(got["step"]), tuple(got["members"]), tuple(got["joiners"]), int(got["group_id"]))

    def _alive(self, island: int, now: float, seen: dict[int, tuple[int, float]], retry: bool = False) -> bool:
        key = f"hb/{island}"
        if not self.store.check([key]):
            return True  # not started yet: wait for it (up to the quorum timeout)
        if self.store.check([f"restarting/{island}"]):
            # A restarted island joins at a first try (the next outer step), never at a retry of one
            # it died in (e.g. while a delayed exchange was in flight): a retry does not wait for it.
            return not retry
        count = self.store.add(key, 0)
        last = seen.get(island)
        if last is None or last[0] != count:
            seen[island] = (count, now)
            return True
        return now - last[1] < STALE_S

    def progress(self) -> dict | None:
        """The last quorum's record (None before the first outer step)."""
        raw = self.store.get("q/last").decode() if self.store.check(["q/last"]) else ""
        return json.loads(raw) if raw else None

    # --- groups ---------------------------------------------------------------------
    def use(self, quorum: Quorum) -> None:
        """Talk to ``quorum``'s islands from now on (a new group if its members changed)."""
        self.quorum = quorum
        key = quorum.group_id
        if key not in self._groups:
            members = quorum.members
            size = len(members)
            prefix = dist.PrefixStore(f"pg/{key}/r{self.local_rank}", self.store)
            try:
                pg = dist.ProcessGroupGloo(prefix, members.index(self.island), size, self.timeout)
            except RuntimeError as exc:
                raise CollectiveError(f"islands: forming the group of islands {list(members)} failed: "
                                      f"{str(exc).strip().splitlines()[0]}") from exc
            self._groups = {key: (pg, members)}  # the old group's islands are gone or changed
        self.group = self._groups[key][0]

    @property
    def rank(self) -> int:
        return self.quorum.members.index(self.island)

    @property
    def size(self) -> int:
        return len(self.quorum.members)

    # --- ops (host tensors) -----------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, wait: bool = True) -> Pending | None:
        """Sum ``t`` over the quorum's islands, in place (``wait=False``: started, and its
        :class:`Pending` returned; ``t`` holds the sum once that is waited for)."""
        return self._op("all_reduce", [t], lambda: self.group.allreduce([t]), wait=wait)

    def all_gather(self, t: torch.Tensor, *, wait: bool = True) -> list[torch.Tensor] | tuple[list[torch.Tensor], Pending]:
        """Every island's ``t``, in member order (``wait=False``: the list to be filled and its :class:`Pending`)."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        pending = self._op("all_gather", [t], lambda: self.group.allgather([out], [t]), wait=wait)
        return out if wait else (out, pending)

    def broadcast(self, tensors: Sequence[torch.Tensor], src_island: int) -> None:
        """Copy ``tensors`` from island ``src_island`` to the quorum's islands."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.quorum.members.index(src_island)
        for t in tensors:
            self._op("broadcast", [t], lambda t=t: self.group.broadcast([t], opts), sends=src_island == self.island)

    def _op(self, op: str, tensors: list[torch.Tensor], fn, sends: bool = True, wait: bool = True) -> Pending | None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.wire_dir is not None and sends:  # a broadcast's receivers hand over a buffer to fill
            self.record(op, tensors)
        t0 = time.perf_counter()
        members = list(self.quorum.members)
        try:
            work = fn()
        except RuntimeError as exc:
            self._count(op, nbytes, time.perf_counter() - t0)
            raise _failed(op, members, exc) from exc
        pending = Pending(self, op, members, work, nbytes, t0 if wait else None)
        if not wait:
            return pending
        pending.wait()
        return None

    def record(self, op: str, tensors: list[torch.Tensor], sent: bool = True) -> None:
        """Write ``tensors`` to the wire log as ``<seq>-<op>.pt`` (``sent``: handed to the link;
        False: kept here, for an audit to compare with what was sent)."""
        self.wire_dir.mkdir(parents=True, exist_ok=True)
        self._wire_seq += 1
        torch.save({"op": op, "sent": sent, "members": list(self.quorum.members) if self.quorum else [],
                    "tensors": [t.detach().cpu().clone() for t in tensors]},
                   self.wire_dir / f"{self._wire_seq:06d}-{op}.pt")

    def _count(self, op: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        c = self.stats.counter(op)
        c.calls += calls
        c.bytes += nbytes
        c.seconds += seconds

    def totals(self) -> tuple[int, int, float]:
        """(calls, bytes, seconds) so far, every op together."""
        ops = self.stats.ops.values()
        return sum(c.calls for c in ops), sum(c.bytes for c in ops), sum(c.seconds for c in ops)


def _failed(op: str, members: list[int], exc: RuntimeError) -> CollectiveError:
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveError(f"islands: {op} between islands {members} failed: {why}")


class Pending:
    """An op between islands started but not yet waited for (``islands.overlap = "delayed"``).

    Its call and bytes are counted when it starts, so a step's ``cross_island`` shows them where
    the blocking mode would; its seconds are the time this rank then waits in :meth:`wait` (the
    part of the exchange the inner steps did not hide), counted when it is waited for. A peer
    that died fails the wait with a CollectiveError within the link's timeout, as a blocking op."""

    def __init__(self, link: IslandLink, op: str, members: list[int], work, nbytes: int, t0: float | None):
        self.link, self.op, self.members, self.work = link, op, members, work
        self.done = False
        link._count(op, nbytes, 0.0)
        self._t0 = t0  # a blocking op: its seconds run from its start

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        t0 = self._t0 if self._t0 is not None else time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise _failed(self.op, self.members, exc) from exc
        finally:
            self.link._count(self.op, 0, time.perf_counter() - t0, calls=0)
