"""Check a pipeline schedule before anything runs: a small simulator of every rank at once.

Two passes, each raising :class:`ScheduleError` (a ConfigError: exit 2) that names the
rank, the instruction index and the instruction:

1. Per rank, in order: every (chunk, micro-batch) is run forward once and backward once,
   backward after forward; a forward on a non-first virtual stage comes after its
   activation was received (or, from a virtual stage on the same rank, after that stage's
   forward), a backward on a non-last one after its gradient was received (or after the
   same-rank next stage's backward); sends come after the compute that produces them; peers
   are the neighbouring virtual stages' ranks, never the rank itself.
2. All ranks together, under the strictest transport semantics (a transfer completes
   only once both sides have posted it; a batch of consecutive transfers blocks until all
   of it completes; the n-th send on an ordered pair of ranks meets the n-th receive).
   A schedule with ``buffered_sends`` (ZBV) waits its sends only at the end of the step, and
   is checked so: its batches block on their receives alone, and every send must be received.
   Anything that cannot make progress is a deadlock; a send meeting a receive of another
   kind, micro-batch or stage is a mismatch. A schedule that passes under these
   semantics also runs under laxer (buffered) ones.

The timing is a third pass, under the semantics the runtime has
(:class:`chipset.runtime.pipeline.engine.PipelineEngine`): the receives that follow a compute op are
posted as it starts, a batch waits for its receives and for the sends of the rank's previous
batch of transfers, and every send is waited at the end of the step (a buffered schedule waits
its sends there only). These are laxer than pass 2's, so a schedule pass 2 accepts runs under
them. It times every compute instruction (forward = 1, backward = 2 units by default; a split
backward's input and weight halves 1 each) and so gives the schedule's bubble and a printable
timeline.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from chipset.errors import ConfigError
from chipset.runtime.pipeline.schedules import Instruction, Op, PipelineSchedule

__all__ = ["ScheduleError", "SimResult", "check_schedule", "render"]


class ScheduleError(ConfigError):
    """A pipeline schedule would deadlock, mismatch transfers or compute out of order."""


@dataclass
class SimResult:
    """Timing of a checked schedule: ``spans[r]`` = [(start, end, instruction)] of rank r's compute."""

    schedule: PipelineSchedule
    spans: list[list[tuple[float, float, Instruction]]] = field(default_factory=list)
    makespan: float = 0.0
    forward_cost: float = 1.0
    backward_cost: float = 2.0

    @property
    def bubble(self) -> float:
        """Idle time over ideal time (m*v*(f+b) per rank), as docs/formulas.md defines the bubble."""
        s = self.schedule
        ideal = s.micro_batches * s.virtual_stages * (self.forward_cost + self.backward_cost)
        return (self.makespan - ideal) / ideal

    def timeline(self) -> str:
        s = self.schedule
        width = max(len(ins.cell(s.virtual_stages)) for spans in self.spans for _, _, ins in spans) + 1
        cols = int(round(self.makespan))
        rows = []
        for r, spans in enumerate(self.spans):
            cells = ["." * 1 + " " * (width - 1)] * cols
            for start, end, ins in spans:
                label = ins.cell(s.virtual_stages)
                for t in range(int(round(start)), int(round(end))):
                    cells[t] = label.ljust(width)
            rows.append(f"  rank {r}: " + "".join(cells).rstrip())
        return "\n".join(rows)


def _fail(schedule: PipelineSchedule, rank: int, index: int, ins: Instruction | None, problem: str) -> ScheduleError:
    where = f"rank {rank}, instruction {index} ({ins})" if ins is not None else f"rank {rank}"
    return ScheduleError(
        f"pipeline schedule {schedule.name!r} (p={schedule.stages}, m={schedule.micro_batches}, "
        f"v={schedule.virtual_stages}) is broken at {where}: {problem}. "
        "Fix the schedule generator, or choose another parallel.schedule"
    )


def _static_check(s: PipelineSchedule) -> None:
    p, m, v = s.stages, s.micro_batches, s.virtual_stages
    last = s.num_virtual - 1
    if len(s.ranks) != p:
        raise ScheduleError(f"pipeline schedule {s.name!r} lists {len(s.ranks)} ranks, expected {p}")
    for r, instrs in enumerate(s.ranks):
        done_f, done_b, done_w, got_act, got_grad = set(), set(), set(), set(), set()
        split = any(ins.op is Op.BACKWARD_WEIGHT for ins in instrs)
        for i, ins in enumerate(instrs):
            key = (ins.chunk, ins.mb)
            if not (0 <= ins.chunk < v and 0 <= ins.mb < m):
                raise _fail(s, r, i, ins, f"chunk must be in [0, {v}) and micro-batch in [0, {m})")
            vs = s.virtual_stage(r, ins.chunk)
            if not ins.op.is_compute:
                want = {Op.SEND_ACT: vs + 1, Op.RECV_ACT: vs - 1, Op.SEND_GRAD: vs - 1, Op.RECV_GRAD: vs + 1}[ins.op]
                if not 0 <= want <= last:
                    raise _fail(s, r, i, ins, f"virtual stage {vs} has no neighbour {want} to transfer with")
                if ins.peer != s.locate(want)[0]:
                    raise _fail(s, r, i, ins, f"peer must be rank {s.locate(want)[0]} (virtual stage {want})")
            if not ins.op.is_compute and ins.peer == r:
                raise _fail(s, r, i, ins, "neighbouring virtual stages on one rank hand off locally, without a transfer")
            prev_local = s.local_neighbour(r, ins.chunk, -1)
            next_local = s.local_neighbour(r, ins.chunk, +1)
            if ins.op is Op.FORWARD:
                if key in done_f:
                    raise _fail(s, r, i, ins, "this forward already ran")
                if prev_local is not None and (prev_local, ins.mb) not in done_f:
                    raise _fail(s, r, i, ins, f"forward before the forward of chunk {prev_local} it takes its input from")
                if vs > 0 and prev_local is None and key not in got_act:
                    raise _fail(s, r, i, ins, "forward before its input activation was received (RECV_ACT)")
                done_f.add(key)
            elif ins.op.sends_gradient:
                if (ins.op is Op.BACKWARD) == split:
                    raise _fail(s, r, i, ins, "a rank's backwards are either all whole or all split into "
                                              "BACKWARD_INPUT and BACKWARD_WEIGHT")
                if key in done_b:
                    raise _fail(s, r, i, ins, "this backward already ran")
                if key not in done_f:
                    raise _fail(s, r, i, ins, "backward before its forward")
                if next_local is not None and (next_local, ins.mb) not in done_b:
                    raise _fail(s, r, i, ins, f"backward before the backward of chunk {next_local} it takes its "
                                              "output gradient from")
                if vs < last and next_local is None and key not in got_grad:
                    raise _fail(s, r, i, ins, "backward before its output gradient was received (RECV_GRAD)")
                done_b.add(key)
            elif ins.op is Op.BACKWARD_WEIGHT:
                if key in done_w:
                    raise _fail(s, r, i, ins, "this weight gradient already ran")
                if key not in done_b:
                    raise _fail(s, r, i, ins, "weight gradient before its input gradient (BACKWARD_INPUT)")
                done_w.add(key)
            elif ins.op is Op.SEND_ACT and key not in done_f:
                raise _fail(s, r, i, ins, "activation sent before the forward that produces it")
            elif ins.op is Op.SEND_GRAD and key not in done_b:
                raise _fail(s, r, i, ins, "gradient sent before the backward that produces it")
            elif ins.op is Op.RECV_ACT:
                got_act.add(key)
            elif ins.op is Op.RECV_GRAD:
                got_grad.add(key)
        everything = {(c, mb) for c in range(v) for mb in range(m)}
        whats = (("forward", done_f), ("backward", done_b)) + ((("weight gradient", done_w),) if split else ())
        for what, done in whats:
            if done != everything:
                c, mb = min(everything - done)
                raise _fail(s, r, len(instrs), None, f"never runs the {what} of chunk {c}, micro-batch {mb}")


def _edge(s: PipelineSchedule, rank: int, ins: Instruction) -> tuple[str, int, int]:
    """What a transfer carries: (kind, micro-batch, lower virtual stage of the edge)."""
    vs = s.virtual_stage(rank, ins.chunk)
    if ins.op is Op.SEND_ACT:
        return ("activation", ins.mb, vs)
    if ins.op is Op.RECV_ACT:
        return ("activation", ins.mb, vs - 1)
    if ins.op is Op.SEND_GRAD:
        return ("gradient", ins.mb, vs - 1)
    return ("gradient", ins.mb, vs)


def check_schedule(s: PipelineSchedule, *, forward_cost: float = 1.0, backward_cost: float = 2.0) -> SimResult:
    """Raise :class:`ScheduleError` unless ``s`` is well-formed and deadlock-free; return its timing."""
    _static_check(s)
    p = s.stages
    pc = [0] * p  # next instruction per rank
    # FIFO of posted-but-unmatched transfers per ordered (src, dst) pair, per side.
    sends: dict[tuple[int, int], deque] = defaultdict(deque)
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)
    posted: list[list | None] = [None] * p  # the open batch per rank: its transfers' states
    n_sent: dict[tuple[int, int], int] = defaultdict(int)
    n_recv: dict[tuple[int, int], int] = defaultdict(int)

    def post_batch(r: int) -> None:
        instrs = s.ranks[r]
        ops = []
        while pc[r] < len(instrs) and not instrs[pc[r]].op.is_compute:
            ins = instrs[pc[r]]
            state = {"rank": r, "index": pc[r], "ins": ins, "done": False}
            if ins.op.is_send:
                pair = (r, ins.peer)
                state["seq"] = n_sent[pair]
                n_sent[pair] += 1
                mine, theirs = sends[pair], recvs[pair]
            else:
                pair = (ins.peer, r)
                state["seq"] = n_recv[pair]
                n_recv[pair] += 1
                mine, theirs = recvs[pair], sends[pair]
            if theirs:
                other = theirs.popleft()
                a, b = (state, other) if ins.op.is_send else (other, state)
                ea, eb = _edge(s, a["rank"], a["ins"]), _edge(s, b["rank"], b["ins"])
                if ea != eb:
                    raise _fail(
                        s, r, pc[r], ins,
                        f"transfer #{state['seq']} between ranks {a['rank']} -> {b['rank']} pairs "
                        f"rank {a['rank']} instruction {a['index']} ({a['ins']}, the {ea[0]} of micro-batch {ea[1]} "
                        f"leaving virtual stage {ea[2]}) with rank {b['rank']} instruction {b['index']} "
                        f"({b['ins']}, expecting the {eb[0]} of micro-batch {eb[1]} leaving virtual stage {eb[2]})",
                    )
                b["done"] = True  # the receive completes once both sides posted
                if not s.buffered_sends:
                    a["done"] = True
            else:
                mine.append(state)
            if s.buffered_sends and ins.op.is_send:
                state["done"] = True  # posted; waited only at the end of the step
            ops.append(state)
            pc[r] += 1
        posted[r] = ops

    while True:
        progressed = False
        for r in range(p):
            instrs = s.ranks[r]
            while True:
                if posted[r] is not None:
                    ops = posted[r]
                    if not all(o["done"] for o in ops):
                        break
                    posted[r] = None
                    progressed = True
                    continue
                if pc[r] >= len(instrs):
                    break
                ins = instrs[pc[r]]
                if ins.op.is_compute:
                    pc[r] += 1
                else:
                    post_batch(r)
                progressed = True
        if all(pc[r] >= len(s.ranks[r]) and posted[r] is None for r in range(p)):
            break
        if not progressed:
            blocked = []
            for r in range(p):
                for o in posted[r] or []:
                    if not o["done"]:
                        blocked.append(f"rank {r} instruction {o['index']} ({o['ins']}) waits for rank {o['ins'].peer}")
                        break
            first = next(r for r in range(p) if posted[r] is not None)
            o = next(o for o in posted[first] if not o["done"])
            raise _fail(s, first, o["index"], o["ins"],
                        "deadlock: no rank can make progress; " + "; ".join(blocked))
    for (src, dst), queue in sends.items():
        if queue:
            o = queue[0]
            raise _fail(s, src, o["index"], o["ins"], f"rank {dst} never receives this send")
    spans, makespan = _runtime_timing(s, forward_cost, backward_cost)
    return SimResult(s, spans, makespan, forward_cost, backward_cost)


def _runtime_timing(s: PipelineSchedule, forward_cost: float,
                    backward_cost: float) -> tuple[list[list[tuple[float, float, Instruction]]], float]:
    """Each rank's compute spans and the makespan under the runtime's semantics (module docstring):
    a batch's receives are posted when the compute op before it starts, its sends when it is reached;
    a transfer completes once both are posted. Only called on a schedule pass 2 accepted."""
    p = s.stages
    segments: list[list[tuple[list[Instruction], Instruction | None]]] = []  # (transfers, then compute)
    for instrs in s.ranks:
        rank_segments, batch = [], []
        for ins in instrs:
            if ins.op.is_compute:
                rank_segments.append((batch, ins))
                batch = []
            else:
                batch.append(ins)
        rank_segments.append((batch, None))
        segments.append(rank_segments)
    posted: dict[tuple[str, int, int, int], float] = {}  # (side, src, dst, n-th on the pair) -> time
    count: dict[tuple[str, int, int], int] = defaultdict(int)

    def post(side: str, src: int, dst: int, t: float) -> tuple[int, int, int]:
        n = count[(side, src, dst)]
        count[(side, src, dst)] += 1
        posted[(side, src, dst, n)] = t
        return (src, dst, n)

    def completed(key: tuple[int, int, int]) -> float | None:
        a, b = posted.get(("send", *key)), posted.get(("recv", *key))
        return None if a is None or b is None else max(a, b)

    receives: list[dict[int, list]] = [{} for _ in range(p)]  # segment -> its receives' keys
    sends: list[dict[int, list]] = [{} for _ in range(p)]
    unwaited: list[list] = [[] for _ in range(p)]  # sends the rank's next non-empty batch waits
    index, clock = [0] * p, [0.0] * p
    spans: list[list[tuple[float, float, Instruction]]] = [[] for _ in range(p)]

    def post_receives(r: int, k: int, t: float) -> None:
        if k < len(segments[r]) and k not in receives[r]:
            receives[r][k] = [post("recv", ins.peer, r, t) for ins in segments[r][k][0]
                              if ins.op in (Op.RECV_ACT, Op.RECV_GRAD)]

    while not all(index[r] == len(segments[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while index[r] < len(segments[r]):
                k = index[r]
                batch, compute = segments[r][k]
                post_receives(r, k, clock[r])
                if k not in sends[r]:
                    sends[r][k] = [post("send", r, ins.peer, clock[r]) for ins in batch if ins.op.is_send]
                waits = list(receives[r][k])
                if batch and not s.buffered_sends:
                    waits += unwaited[r]
                if compute is None:  # the end of the step: every send
                    waits += [key for keys in sends[r].values() for key in keys]
                done = [completed(key) for key in waits]
                if None in done:
                    break
                start = max([clock[r], *done])
                if batch and not s.buffered_sends:
                    unwaited[r] = sends[r][k]
                if compute is not None:
                    post_receives(r, k + 1, start)
                    # A split backward's halves: half the backward's cost each.
                    cost = (forward_cost if compute.op is Op.FORWARD else backward_cost if compute.op is Op.BACKWARD
                            else backward_cost / 2)
                    spans[r].append((start, start + cost, compute))
                    start += cost
                clock[r] = start
                index[r] += 1
                progressed = True
        if not progressed:  # pass 2 accepted the schedule under stricter semantics: a bug here
            raise RuntimeError(f"pipeline schedule {s.name!r}: the runtime-semantics timing made no progress")
    return spans, max(clock)


def render(schedule: PipelineSchedule) -> str:
    """Readable form of ``schedule``, checked: the header, a per-rank timeline, then every rank's
    instruction list (what ``chipset train --print-schedule`` prints)."""
    sim = check_schedule(schedule)
    split = any(ins.op is Op.BACKWARD_WEIGHT for instrs in schedule.ranks for ins in instrs)
    lines = [
        f"pipeline schedule {schedule.name}: {schedule.stages} ranks, {schedule.micro_batches} micro-batches, "
        f"{schedule.virtual_stages} chunk(s) per rank",
        f"checked: deadlock-free, every send matches its receive; simulated bubble {sim.bubble:.3f} "
        f"(theory {schedule.theoretical_bubble():.3f}) with forward = 1, backward = 2 time units"
        + (" (its input half B and weight half W 1 each)" if split else ""),
        "",
        "timeline (one column per time unit; . = idle):",
        sim.timeline(),
        "",
    ]
    for r, instrs in enumerate(schedule.ranks):
        lines.append(f"rank {r} ({len(instrs)} instructions):")
        batch_open = False
        for i, ins in enumerate(instrs):
            is_xfer = not ins.op.is_compute
            joined = is_xfer and batch_open
            lines.append(f"  {i:>3}  {'+ ' if joined else '  '}{ins}")
            batch_open = is_xfer
        lines.append("")
    lines.append("'+' marks a transfer posted in the same batch as the line above.")
    return "\n".join(lines)
