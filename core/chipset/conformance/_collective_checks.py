"""The collectives battery: every check runs inside one multi-rank session (see _world).

Each check is a function ``fn(ctx)`` run on every rank, raising AssertionError on a
wrong result. Values are drawn from the check's own seed (:func:`values`): different per
check, per call and per session (``CHIPSET_CONFORMANCE_SEED`` pins it), so a backend that
returns a cached earlier result of the same shape fails; floating values span exponents
that only the declared dtype holds (beyond float16's range, below its precision) with
mantissas whose sums are exact, so results are still compared exactly. The check list is static (test ids are known at collection); whether a check
runs is decided on each rank from the declared Capabilities, identically everywhere.
"""

from __future__ import annotations

import os
import time
import zlib
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
TIMEOUT_GRACE_S = 5.0
"""How long past TIMEOUT_S the timeout may take to surface before the check fails (a
watchdog in the rank then reports it by name instead of waiting for the session deadline)."""


@dataclass
class Ctx:
    collective: object
    device: object
    dev: torch.device
    rank: int
    world: int
    seed: int = 0
    """This check's seed: the session seed mixed with the check's id (set per check)."""


@dataclass(frozen=True)
class Check:
    id: str
    fn: Callable[[Ctx], None]
    capability: str
    dtype: str | None = None
    min_world: int = 2
    watchdog_s: float | None = None
    """Seconds after which a rank still inside this check reports it as hung (None: the
    session's collective timeout plus a margin)."""
    hang_message: str = ""
    """The verdict the watchdog writes, ``{rank}`` and ``{seconds}`` filled in."""


def _numel(size: str, dt: torch.dtype) -> int:
    return BIG_BYTES // dt.itemsize if size == "4MiB" else int(size)


# Per float dtype: (largest mantissa magnitude, exponents drawn per element). WORLD ranks'
# mantissas sum exactly in the dtype's precision, so sums and maxima compare exactly; the
# exponents put values outside float16's range and below its precision for bfloat16, and
# need float16's 11 bits (no bfloat16 holds them) for float16.
_FLOAT_VALUES = {
    torch.bfloat16: (64, (-40, -3, 0, 20)),
    torch.float16: (511, (-20, -4, 0, 4)),
    torch.float32: (1 << 20, (-100, -10, 0, 60)),
    torch.float64: (1 << 40, (-300, 0, 300)),
}
INT_MAX = 1 << 40
"""Integers are drawn from [0, 2**40): an int32 transport cannot carry them."""


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)


def values(seed: int, rep: int, n: int, dt: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input of repetition ``rep`` of the check seeded ``seed`` (CPU tensor).

    Every rank can compute every other rank's values, so each derives the expected result;
    the element exponents are shared by all ranks (so sums stay exact), the mantissas are not.
    """
    if not dt.is_floating_point:
        return torch.randint(0, INT_MAX, (n,), generator=_gen(seed, rep, rank), dtype=torch.int64).to(dt)
    return (_mantissas(seed, rep, n, dt, rank) * _scales(seed, rep, n, dt)).to(dt)


def _scales(seed: int, rep: int, n: int, dt: torch.dtype) -> torch.Tensor:
    """The elements' powers of two (float64), shared by every rank."""
    _, exps = _FLOAT_VALUES[dt]
    table = torch.tensor([2.0 ** x for x in exps], dtype=torch.float64)  # exact: powers of two
    return table[torch.randint(0, len(exps), (n,), generator=_gen(seed, rep))]


def _mantissas(seed: int, rep: int, n: int, dt: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s integer mantissas, as float64."""
    mmax, _ = _FLOAT_VALUES[dt]
    return torch.randint(-mmax, mmax + 1, (n,), generator=_gen(seed, rep, rank), dtype=torch.int64).to(torch.float64)


def _all(seed: int, rep: int, n: int, dt: torch.dtype, w: int) -> torch.Tensor:
    """Every rank's values stacked, in float64 (exact for every float dtype) or int64."""
    if not dt.is_floating_point:
        return torch.stack([values(seed, rep, n, dt, j).to(torch.int64) for j in range(w)])
    # What values() gives rank j, widened back to float64 (the dtype's rounding of m * 2**e is
    # exact: the mantissas fit the dtype, the powers of two its range), the scales drawn once.
    return torch.stack([_mantissas(seed, rep, n, dt, j) for j in range(w)]) * _scales(seed, rep, n, dt)


def _expect(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if rtol or atol:
        wrong = ~torch.isclose(got.double(), want.double(), rtol=rtol, atol=atol)
    else:
        wrong = got != want
    if wrong.any():
        i = tuple(wrong.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(wrong.sum())} of {want.numel()} elements wrong; first at {i}: "
            f"got {got[i].item()}, expected {want[i].item()}"
        )


def _reps(size: str) -> int:
    # Two calls of the same shape with different values: a cached earlier result fails the second.
    return 1 if size == "4MiB" else 2


def _op_check(op: str, dtype: str, size: str) -> Callable[[Ctx], None]:
    dt = DTYPES[dtype]

    def run(ctx: Ctx) -> None:
        c, r, w, dev = ctx.collective, ctx.rank, ctx.world, ctx.dev
        n = _numel(size, dt)
        for rep in range(_reps(size)):
            _op_once(ctx, c, r, w, dev, n, rep, f"rank {r}: {op} {dtype} x{n} (seed {ctx.seed}, call {rep + 1})")

    def _op_once(ctx, c, r, w, dev, n, rep, label):
        mine = values(ctx.seed, rep, n, dt, r)
        if op.startswith("all_reduce"):
            red = op.removeprefix("all_reduce_")
            x = mine.clone().to(dev)
            c.all_reduce(x, red)
            every = _all(ctx.seed, rep, n, dt, w)
            if red == "sum":
                _expect(x, every.sum(0).to(dt), label)
            elif red == "max":
                _expect(x, every.max(0).values.to(dt), label)
            elif dt.is_floating_point:
                fi = torch.finfo(dt)
                # one rounding of the exact mean, plus the division's own
                _expect(x, (every.sum(0) / w).to(dt), label, rtol=2 * fi.eps, atol=fi.smallest_normal * fi.eps)
            else:
                _expect(x, torch.div(every.sum(0), w, rounding_mode="trunc").to(dt), label)
        elif op == "all_gather":
            out = torch.empty(n * w, dtype=dt, device=dev)
            c.all_gather(out, mine.to(dev))
            _expect(out, _all(ctx.seed, rep, n, dt, w).reshape(-1).to(dt), label)
        elif op == "reduce_scatter":
            out = torch.empty(n, dtype=dt, device=dev)
            c.reduce_scatter(out, values(ctx.seed, rep, n * w, dt, r).to(dev))
            want = _all(ctx.seed, rep, n * w, dt, w).sum(0)[r * n:(r + 1) * n]
            _expect(out, want.to(dt), label)
        elif op == "broadcast":
            x = mine.clone().to(dev)
            c.broadcast(x, src=w - 1)
            _expect(x, values(ctx.seed, rep, n, dt, w - 1), label)
        elif op == "all_to_all":
            # block j of rank r's input goes to rank j
            inp = values(ctx.seed, rep, n * w, dt, r)
            out = torch.empty(n * w, dtype=dt, device=dev)
            c.all_to_all(out, inp.to(dev))
            want = torch.cat([values(ctx.seed, rep, n * w, dt, j)[r * n:(r + 1) * n] for j in range(w)])
            _expect(out, want, label)
        elif op == "send_recv":
            if r == 0:
                c.send(mine.to(dev), dst=1)
                back = torch.empty(n, dtype=dt, device=dev)
                c.recv(back, src=1)
                _expect(back, values(ctx.seed, rep, n, dt, 1), label)
            elif r == 1:
                got = torch.empty(n, dtype=dt, device=dev)
                c.recv(got, src=0)
                _expect(got, values(ctx.seed, rep, n, dt, 0), label)
                c.send(mine.to(dev), dst=0)
        else:  # pragma: no cover
            raise AssertionError(f"unknown op {op}")

    return run


def _async_check(op: str) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        c, r, w, dev, sd = ctx.collective, ctx.rank, ctx.world, ctx.dev, ctx.seed
        n, dt = 37, torch.float32
        if op == "all_reduce":
            out = values(sd, 0, n, dt, r).to(dev)
            h = c.all_reduce(out, "sum", async_op=True)
            want = _all(sd, 0, n, dt, w).sum(0).to(dt)
        elif op == "all_gather":
            out = torch.empty(n * w, dtype=dt, device=dev)
            h = c.all_gather(out, values(sd, 0, n, dt, r).to(dev), async_op=True)
            want = _all(sd, 0, n, dt, w).reshape(-1).to(dt)
        elif op == "reduce_scatter":
            out = torch.empty(n, dtype=dt, device=dev)
            h = c.reduce_scatter(out, values(sd, 0, n * w, dt, r).to(dev), async_op=True)
            want = _all(sd, 0, n * w, dt, w).sum(0)[r * n:(r + 1) * n].to(dt)
        elif op == "broadcast":
            out = values(sd, 0, n, dt, r).to(dev)
            h = c.broadcast(out, src=0, async_op=True)
            want = values(sd, 0, n, dt, 0)
        else:
            out = torch.empty(n * w, dtype=dt, device=dev)
            h = c.all_to_all(out, values(sd, 0, n * w, dt, r).to(dev), async_op=True)
            want = torch.cat([values(sd, 0, n * w, dt, j)[r * n:(r + 1) * n] for j in range(w)])
        assert h is not None and hasattr(h, "wait"), f"async {op} returned {h!r}, expected a handle"
        h.wait()
        ctx.device.synchronize()
        _expect(out, want, f"rank {r}: async {op} (seed {sd})")
        # Completion may be reported a little after wait() returns (a callback thread,
        # a device stream); it must be reported eventually.
        deadline = time.monotonic() + 5
        while not h.is_completed():
            assert time.monotonic() < deadline, f"async {op}: handle never reports completion after wait()"
            time.sleep(0.01)

    return run


def split_size(src: int, dst: int) -> int:
    """Elements rank ``src`` sends rank ``dst`` in the uneven all_to_all: asymmetric, so a
    backend that lays out its output by the input split sizes gets it wrong."""
    return 1 + src + 2 * dst


def _uneven_all_to_all(dtype: str) -> Callable[[Ctx], None]:
    dt = DTYPES[dtype]

    def run(ctx: Ctx) -> None:
        c, r, w, dev, sd = ctx.collective, ctx.rank, ctx.world, ctx.dev, ctx.seed
        for rep in range(2):
            send = [split_size(r, j) for j in range(w)]
            recv = [split_size(j, r) for j in range(w)]

            def payload(src: int, dst: int, rep=rep) -> torch.Tensor:
                sizes = [split_size(src, k) for k in range(w)]
                return values(sd, rep, sum(sizes), dt, src)[sum(sizes[:dst]):sum(sizes[:dst + 1])]

            inp = torch.cat([payload(r, j) for j in range(w)]).to(dev)
            out = torch.empty(sum(recv), dtype=dt, device=dev)
            c.all_to_all(out, inp, output_split_sizes=recv, input_split_sizes=send)
            want = torch.cat([payload(j, r) for j in range(w)])
            _expect(out, want, f"rank {r}: uneven all_to_all {dtype} (input splits {send}, output splits {recv}, "
                    f"seed {sd}, call {rep + 1})")

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
        P2POp("send", values(ctx.seed, 0, 9, torch.float32, r).to(dev), (r + 1) % w),
        P2POp("recv", got, (r - 1) % w),
    ])
    for h in handles:
        h.wait()
    _expect(got, values(ctx.seed, 0, 9, torch.float32, (r - 1) % w), f"rank {r}: batch_p2p ring")


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
        assert took <= TIMEOUT_S + TIMEOUT_GRACE_S, (
            f"collective all_reduce on rank {r} raised CollectiveTimeoutError after {took:.1f} s, "
            f"more than the declared {TIMEOUT_S} s + {TIMEOUT_GRACE_S} s"
        )
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
        Check("timeout_raises_collective_timeout_error", _timeout, "all_reduce", "float32",
              watchdog_s=TIMEOUT_S + TIMEOUT_GRACE_S,
              hang_message="collective all_reduce on rank {rank} did not raise CollectiveTimeoutError "
                           f"within {TIMEOUT_S:g} s (+{TIMEOUT_GRACE_S:g} s grace): still blocked after {{seconds:g}} s"),
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
