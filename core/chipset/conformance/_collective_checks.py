"""The collectives battery: every check runs inside one multi-rank session (see _world).

Each check is a function ``fn(ctx)`` run on every rank, raising AssertionError on a
wrong result. Values are small integers, exact in every dtype, so results are compared
exactly. The check list is static (test ids are known at collection); whether a check
runs is decided on each rank from the declared Capabilities, identically everywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

WORLD = 3
"""Ranks in the battery's session: three, so subgroups are proper and rings are odd."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}
SIZES = ("0", "1", "37", "4MiB")
BIG_BYTES = 4 << 20
OPS = (
    "all_reduce_sum", "all_reduce_max", "all_reduce_avg", "all_gather", "reduce_scatter",
    "broadcast", "all_to_all", "send_recv",
)
ASYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
TIMEOUT_S = 3.0
"""Collective timeout of the group the timeout check uses."""


@dataclass
class Ctx:
    collective: object
    device: object
    dev: torch.device
    rank: int
    world: int


@dataclass(frozen=True)
class Check:
    id: str
    fn: Callable[[Ctx], None]
    capability: str
    dtype: str | None = None
    min_world: int = 2


def _numel(size: str, dt: torch.dtype) -> int:
    return BIG_BYTES // dt.itemsize if size == "4MiB" else int(size)


def _base(n: int, dt: torch.dtype, offset: int = 0) -> torch.Tensor:
    return ((torch.arange(n) % 7) + offset).to(dt)


def _expect(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        i = tuple(bad)
        raise AssertionError(
            f"{what}: {int((got != want).sum())} of {want.numel()} elements wrong; first at {i}: "
            f"got {got[i].item()}, expected {want[i].item()}"
        )


def _op_check(op: str, dtype: str, size: str) -> Callable[[Ctx], None]:
    dt = DTYPES[dtype]

    def run(ctx: Ctx) -> None:
        c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
        n = _numel(size, dt)
        label = f"rank {r}: {op} {dtype} x{n}"
        if op.startswith("all_reduce"):
            red = op.removeprefix("all_reduce_")
            x = (_base(n, dt) + r).to(dev)
            c.all_reduce(x, red)
            b = _base(n, torch.float64)
            total = w * b + w * (w - 1) / 2
            if red == "sum":
                want = total
            elif red == "max":
                want = b + (w - 1)
            elif dt.is_floating_point:
                want = total / w
            else:
                want = torch.div(total.to(torch.int64), w, rounding_mode="trunc")
            _expect(x, want.to(dt), label)
        elif op == "all_gather":
            out = torch.empty(n * w, dtype=dt, device=dev)
            c.all_gather(out, (_base(n, dt) + r).to(dev))
            _expect(out, torch.cat([_base(n, dt) + j for j in range(w)]), label)
        elif op == "reduce_scatter":
            out = torch.empty(n, dtype=dt, device=dev)
            c.reduce_scatter(out, (_base(n * w, dt) + r).to(dev))
            want = w * _base(n * w, torch.float64)[r * n:(r + 1) * n] + w * (w - 1) / 2
            _expect(out, want.to(dt), label)
        elif op == "broadcast":
            x = (_base(n, dt) + r).to(dev)
            c.broadcast(x, src=w - 1)
            _expect(x, _base(n, dt) + (w - 1), label)
        elif op == "all_to_all":
            inp = torch.cat([_base(n, dt) + 10 * r + j for j in range(w)]).to(dev)
            out = torch.empty(n * w, dtype=dt, device=dev)
            c.all_to_all(out, inp)
            _expect(out, torch.cat([_base(n, dt) + 10 * j + r for j in range(w)]), label)
        elif op == "send_recv":
            if r == 0:
                c.send((_base(n, dt) + 1).to(dev), dst=1)
                back = torch.empty(n, dtype=dt, device=dev)
                c.recv(back, src=1)
                _expect(back, _base(n, dt) + 2, label)
            elif r == 1:
                got = torch.empty(n, dtype=dt, device=dev)
                c.recv(got, src=0)
                _expect(got, _base(n, dt) + 1, label)
                c.send((_base(n, dt) + 2).to(dev), dst=0)
        else:  # pragma: no cover
            raise AssertionError(f"unknown op {op}")

    return run


def _async_check(op: str) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
        n, dt = 37, torch.float32
        if op == "all_reduce":
            x = (_base(n, dt) + r).to(dev)
            h = c.all_reduce(x, "sum", async_op=True)
            out, want = x, w * _base(n, dt) + w * (w - 1) / 2
        elif op == "all_gather":
            out = torch.empty(n * w, dtype=dt, device=dev)
            h = c.all_gather(out, (_base(n, dt) + r).to(dev), async_op=True)
            want = torch.cat([_base(n, dt) + j for j in range(w)])
        elif op == "reduce_scatter":
            out = torch.empty(n, dtype=dt, device=dev)
            h = c.reduce_scatter(out, (_base(n * w, dt) + r).to(dev), async_op=True)
            want = w * _base(n * w, dt)[r * n:(r + 1) * n] + w * (w - 1) / 2
        elif op == "broadcast":
            out = (_base(n, dt) + r).to(dev)
            h = c.broadcast(out, src=0, async_op=True)
            want = _base(n, dt)
        else:
            inp = torch.cat([_base(n, dt) + 10 * r + j for j in range(w)]).to(dev)
            out = torch.empty(n * w, dtype=dt, device=dev)
            h = c.all_to_all(out, inp, async_op=True)
            want = torch.cat([_base(n, dt) + 10 * j + r for j in range(w)])
        assert h is not None and hasattr(h, "wait"), f"async {op} returned {h!r}, expected a handle"
        h.wait()
        ctx.device.synchronize()
        _expect(out, want, f"rank {r}: async {op}")
        # Completion may be reported a little after wait() returns (a callback thread,
        # a device stream); it must be reported eventually.
        deadline = time.monotonic() + 5
        while not h.is_completed():
            assert time.monotonic() < deadline, f"async {op}: handle never reports completion after wait()"
            time.sleep(0.01)

    return run


def _uneven_all_to_all(dtype: str) -> Callable[[Ctx], None]:
    dt = DTYPES[dtype]

    def run(ctx: Ctx) -> None:
        c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
        splits = [r + j + 1 for j in range(w)]  # rank r sends r+j+1 elements to rank j
        inp = torch.cat([torch.full((r + j + 1,), 10 * r + j) for j in range(w)]).to(dt).to(dev)
        out = torch.empty(sum(splits), dtype=dt, device=dev)
        c.all_to_all(out, inp, output_split_sizes=splits, input_split_sizes=splits)
        want = torch.cat([torch.full((j + r + 1,), 10 * j + r) for j in range(w)]).to(dt)
        _expect(out, want, f"rank {r}: uneven all_to_all {dtype}")

    return run


def _subgroup(op: str) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
        members = [0, w - 1]
        g = c.new_group(members, name="conformance-sub")  # every rank must call new_group
        assert g.size == 2 and tuple(g.ranks) == tuple(members)
        if r in members:
            if op == "all_reduce":
                x = torch.full((5,), float(r + 1), device=dev)
                c.all_reduce(x, group=g)
                _expect(x, torch.full((5,), float(1 + w)), f"rank {r}: subgroup all_reduce")
            elif op == "all_gather":
                out = torch.empty(2 * 3, device=dev)
                c.all_gather(out, torch.full((3,), float(r), device=dev), group=g)
                _expect(out, torch.tensor([0.0] * 3 + [float(w - 1)] * 3), f"rank {r}: subgroup all_gather")
            else:
                x = torch.full((4,), float(r), device=dev)
                c.broadcast(x, src=w - 1, group=g)
                _expect(x, torch.full((4,), float(w - 1)), f"rank {r}: subgroup broadcast")
        # the world still works after (and around) the subgroup
        y = torch.ones(3, device=dev)
        c.all_reduce(y)
        _expect(y, torch.full((3,), float(w)), f"rank {r}: world all_reduce after subgroup {op}")

    return run


def _batch_p2p_ring(ctx: Ctx) -> None:
    from chipset.interfaces import P2POp

    c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
    got = torch.empty(9, device=dev)
    handles = c.batch_p2p([
        P2POp("send", (_base(9, torch.float32) + r).to(dev), (r + 1) % w),
        P2POp("recv", got, (r - 1) % w),
    ])
    for h in handles:
        h.wait()
    _expect(got, _base(9, torch.float32) + (r - 1) % w, f"rank {r}: batch_p2p ring")


def _barrier(ctx: Ctx) -> None:
    c, r, w = ctx.collective, ctx.rank, ctx.world
    late = 1.0
    if r == w - 1:
        time.sleep(late)
    t0 = time.monotonic()
    c.barrier()
    waited = time.monotonic() - t0
    # Generous margin: on a loaded host a rank may reach the barrier a little late itself.
    if r != w - 1:
        assert waited >= late / 2, f"rank {r} left the barrier after {waited:.3f} s, before rank {w - 1} arrived ({late} s late)"


def _timeout(ctx: Ctx) -> None:
    from chipset.errors import CollectiveTimeoutError

    c, r, dev = ctx.collective, ctx.rank, ctx.dev
    saved = os.environ.get("CHIPSET_COLLECTIVE_TIMEOUT")
    os.environ["CHIPSET_COLLECTIVE_TIMEOUT"] = str(TIMEOUT_S)
    try:
        g = c.new_group([0, 1], name="conformance-timeout")
    finally:
        if saved is None:
            os.environ.pop("CHIPSET_COLLECTIVE_TIMEOUT", None)
        else:
            os.environ["CHIPSET_COLLECTIVE_TIMEOUT"] = saved
    if r != 0:
        return  # rank 1 withholds its part; the others are not in the group
    t0 = time.monotonic()
    try:
        c.all_reduce(torch.ones(8, device=dev), group=g)
    except CollectiveTimeoutError:
        took = time.monotonic() - t0
        assert took <= TIMEOUT_S + 30, f"the timeout surfaced after {took:.1f} s, more than {TIMEOUT_S} s + 30 s"
        return
    except Exception as exc:
        raise AssertionError(
            f"a collective whose peer never arrived raised {type(exc).__name__}: {exc}; expected "
            "chipset.CollectiveTimeoutError"
        ) from exc
    raise AssertionError("a collective whose peer never arrived completed instead of timing out")


def battery() -> list[Check]:
    """Every check, in the order each rank runs them (the timeout check last: it leaves a dead group)."""
    out = [
        Check(f"{op}-{dt}-{size}", _op_check(op, dt, size), "all_reduce" if op.startswith("all_reduce") else op, dt)
        for op in OPS for dt in DTYPES for size in SIZES
    ]
    out += [Check(f"async_{op}-float32", _async_check(op), op, "float32") for op in ASYNC_OPS]
    out += [Check(f"all_to_all_uneven-{dt}", _uneven_all_to_all(dt), "all_to_all", dt) for dt in ("float32", "int64")]
    out += [Check(f"subgroup_{op}", _subgroup(op), op, "float32", min_world=3) for op in ("all_reduce", "all_gather", "broadcast")]
    out += [
        Check("batch_p2p_ring", _batch_p2p_ring, "batch_p2p", "float32"),
        Check("barrier_waits_for_all", _barrier, "barrier"),
        Check("timeout_raises_collective_timeout_error", _timeout, "all_reduce", "float32"),
    ]
    return out


CHECK_IDS = [c.id for c in battery()]


def skip_reason(check: Check, caps, world: int) -> str | None:
    """Why ``check`` cannot run on a backend declaring ``caps`` (None: it runs)."""
    if check.capability not in caps.collectives:
        return f"backend does not declare collective {check.capability}"
    if check.dtype is not None and check.dtype not in caps.collective_dtypes:
        return f"backend does not declare collective dtype {check.dtype}"
    if world < check.min_world:
        return f"needs {check.min_world} ranks, the session has {world}"
    return None
