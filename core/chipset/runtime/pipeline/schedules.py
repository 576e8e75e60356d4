"""Pipeline schedules as data: one function per schedule, returning per-rank instruction lists.

A schedule is a :class:`PipelineSchedule`: for each pipeline rank, the ordered list of
:class:`Instruction` it executes in one optimizer step. Nothing here runs a model; the
runtime (:mod:`chipset.runtime.pipeline.engine`) interprets the lists and the checker
(:mod:`chipset.runtime.pipeline.check`) proves them deadlock-free first.

Vocabulary:

* ``p`` pipeline ranks, ``v`` model chunks per rank (virtual stages; 1 except for
  interleaved 1F1B and ZBV), ``m`` micro-batches. Chunk ``c`` of rank ``r`` is virtual stage
  ``c*p + r`` (the "loop" placement); ZBV places two chunks in a V: chunk 0 of rank ``r`` is
  virtual stage ``r``, chunk 1 is ``2p-1-r``, so rank 0 holds the first and the last and rank
  p-1 hands its chunk 0's output to its own chunk 1 without a transfer (a local hand-off).
  Activations flow from virtual stage ``s`` to ``s+1``, gradients back. Virtual stage 0 holds
  the embedding, the last one the head and the loss.
* Compute: ``FORWARD``/``BACKWARD`` of (chunk, micro-batch).
* Transfers: ``SEND_ACT``/``RECV_ACT`` (activations forward), ``SEND_GRAD``/``RECV_GRAD``
  (their gradients backward); ``peer`` is the other side's pipeline rank.
* Batching rule: a maximal run of consecutive transfers is posted together as one
  batched send/recv and waited on as a whole. Between transfers on one ordered pair of
  ranks, the n-th send matches the n-th receive (FIFO), which the checker verifies.

Every schedule is built the same way: a per-rank order of groups of compute
instructions, then :func:`with_transfers` puts the receives a group needs right before
it and the sends it produces right after it, so the sends of one group and the receives
of the next share a batch (Megatron's ``send_forward_recv_backward`` pairing, derived,
not hand-written).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from chipset.errors import ConfigError
from chipset.parallel.schedule import SCHEDULES, bubble_fraction

__all__ = [
    "Op",
    "Instruction",
    "PipelineSchedule",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble",
    "zbv",
    "make_schedule",
    "with_transfers",
]


class Op(str, Enum):
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    BACKWARD_INPUT = "BACKWARD_INPUT"
    """The input-gradient half of a backward (zero-bubble schedules): what the previous stage
    waits for; the weight gradients are deferred to the BACKWARD_WEIGHT of the same micro-batch."""
    BACKWARD_WEIGHT = "BACKWARD_WEIGHT"
    """The deferred weight-gradient half: no transfer waits for it, so it fills the bubble."""
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    @property
    def sends_gradient(self) -> bool:
        """A backward that produces the gradient the previous stage waits for."""
        return self in (Op.BACKWARD, Op.BACKWARD_INPUT)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)


_SHORT = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "B", Op.BACKWARD_WEIGHT: "W", Op.SEND_ACT: "send act", Op.RECV_ACT: "recv act",
          Op.SEND_GRAD: "send grad", Op.RECV_GRAD: "recv grad"}


@dataclass(frozen=True)
class Instruction:
    """One step of one rank: compute on (chunk, micro-batch), or a transfer with ``peer``."""

    op: Op
    mb: int
    chunk: int = 0
    peer: int | None = None
    """The other side's pipeline rank (transfers only)."""

    def __str__(self) -> str:
        where = f"mb {self.mb}" + (f" chunk {self.chunk}" if self.chunk else "")
        if self.op.is_compute:
            return f"{self.op.value} {where}"
        arrow = "->" if self.op.is_send else "<-"
        return f"{self.op.value} {where} {arrow} rank {self.peer}"

    def cell(self, chunks: int) -> str:
        """Short label for timelines: ``F3`` (``F3.1`` for chunk 1 when there are chunks)."""
        return f"{_SHORT[self.op]}{self.mb}" + (f".{self.chunk}" if chunks > 1 else "")


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank instruction lists of one optimizer step (``ranks[r]`` for pipeline rank r)."""

    name: str
    stages: int
    """Pipeline ranks p."""
    micro_batches: int
    virtual_stages: int
    """Model chunks per rank v."""
    ranks: tuple[tuple[Instruction, ...], ...]
    placement: str = "loop"
    """Which virtual stage a rank's chunk holds: "loop" (chunk c of rank r: c*p + r) or "v"
    (two chunks: r, then 2p-1-r)."""
    buffered_sends: bool = False
    """Sends are waited only at the end of the step, not one batch later (ZBV: two ranks send to
    each other both ways, so a send waited earlier can wait on a receive its peer posts only after
    its own send completes). Receives still block where they are."""

    @property
    def num_virtual(self) -> int:
        return self.stages * self.virtual_stages

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return _place(self.placement, self.stages, rank, chunk)

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding ``virtual_stage``."""
        return _locate(self.placement, self.stages, virtual_stage)

    def local_neighbour(self, rank: int, chunk: int, step: int) -> int | None:
        """The chunk of ``rank`` holding the virtual stage ``step`` (-1 or +1) away from its
        chunk ``chunk``'s, when that stage is on the same rank (a hand-off without a transfer)."""
        vs = self.virtual_stage(rank, chunk) + step
        if not 0 <= vs < self.num_virtual:
            return None
        r, c = self.locate(vs)
        return c if r == rank else None

    def theoretical_bubble(self) -> float:
        """:func:`bubble_fraction` of this schedule's shape."""
        return bubble_fraction(self.stages, self.micro_batches, self.virtual_stages, self.name)


def _place(placement: str, p: int, rank: int, chunk: int) -> int:
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def _locate(placement: str, p: int, vs: int) -> tuple[int, int]:
    if placement == "v":
        return (vs, 0) if vs < p else (2 * p - 1 - vs, 1)
    return vs % p, vs // p


def _fwd(chunk: int, mb: int) -> Instruction:
    return Instruction(Op.FORWARD, mb, chunk)


def _bwd(chunk: int, mb: int) -> Instruction:
    return Instruction(Op.BACKWARD, mb, chunk)


def with_transfers(name: str, p: int, m: int, v: int, compute: list[list[tuple[Instruction, ...]]],
                   placement: str = "loop", buffered_sends: bool = False) -> PipelineSchedule:
    """Insert transfers around groups of compute instructions: receives before, sends after.

    ``compute[r]`` is rank r's order as groups run back to back (usually one instruction;
    interleaved 1F1B's steady state pairs a forward with a backward). The transfers
    between two groups (the sends of the one, the receives of the next) form one batch.
    Neighbouring virtual stages on the same rank (ZBV's turn) hand off without a transfer.

    Between two ranks the n-th send meets the n-th receive, so a rank receives from a peer in
    the order the peer sent: when a group needs a message that the peer sent after others this
    rank has not received yet (ZBV, where one pair of ranks carries activations one way and
    gradients the same way), those earlier ones are received in the same batch, ahead of it.
    """
    last = p * v - 1

    def neighbours(r: int, chunk: int) -> tuple[int, int, int]:
        vs = _place(placement, p, r, chunk)
        prev_rank = _locate(placement, p, vs - 1)[0] if vs > 0 else r
        next_rank = _locate(placement, p, vs + 1)[0] if vs < last else r
        return vs, prev_rank, next_rank

    def transfers(r: int, ins: Instruction) -> tuple[list[Instruction], list[Instruction]]:
        """(receives, sends) of one compute instruction of rank r."""
        vs, prev_rank, next_rank = neighbours(r, ins.chunk)
        if ins.op is Op.BACKWARD_WEIGHT:
            return [], []  # nothing waits for it, it waits for nothing
        if ins.op is Op.FORWARD:
            return ([Instruction(Op.RECV_ACT, ins.mb, ins.chunk, prev_rank)] if prev_rank != r else [],
                    [Instruction(Op.SEND_ACT, ins.mb, ins.chunk, next_rank)] if next_rank != r else [])
        return ([Instruction(Op.RECV_GRAD, ins.mb, ins.chunk, next_rank)] if next_rank != r else [],
                [Instruction(Op.SEND_GRAD, ins.mb, ins.chunk, prev_rank)] if prev_rank != r else [])

    def matching_receive(src: int, send: Instruction) -> Instruction:
        vs = _place(placement, p, src, send.chunk) + (1 if send.op is Op.SEND_ACT else -1)
        chunk = _locate(placement, p, vs)[1]
        kind = Op.RECV_ACT if send.op is Op.SEND_ACT else Op.RECV_GRAD
        return Instruction(kind, send.mb, chunk, src)

    # What each ordered pair of ranks carries, in the sender's order.
    sent: dict[tuple[int, int], list[Instruction]] = {}
    for r, groups in enumerate(compute):
        for group in groups:
            for ins in group:
                for send in transfers(r, ins)[1]:
                    sent.setdefault((r, send.peer), []).append(matching_receive(r, send))
    ranks = []
    for r, groups in enumerate(compute):
        out: list[Instruction] = []
        received = {src: 0 for src in range(p)}  # messages taken from each peer so far
        early: set[Instruction] = set()  # received ahead of the group that uses them
        for group in groups:
            recvs, sends = [], []
            for ins in group:
                needed, produced = transfers(r, ins)
                for want in needed:
                    if want in early:
                        early.discard(want)
                        continue
                    queue = sent[(want.peer, r)]
                    while True:
                        got = queue[received[want.peer]]
                        received[want.peer] += 1
                        recvs.append(got)
                        if got == want:
                            break
                        early.add(got)
                sends += produced
            out += recvs + list(group) + sends
        ranks.append(tuple(out))
    return PipelineSchedule(name, p, m, v, tuple(ranks), placement, buffered_sends)


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline schedule needs ranks, micro-batches and chunks >= 1; found p={p}, m={m}, v={v}")


def gpipe(p: int, m: int) -> PipelineSchedule:
    """GPipe: every forward, then every backward (all m micro-batches' activations live at once)."""
    _check_sizes(p, m)
    compute = [[(_fwd(0, i),) for i in range(m)] + [(_bwd(0, i),) for i in range(m)] for _ in range(p)]
    return with_transfers("gpipe", p, m, 1, compute)


def one_f_one_b(p: int, m: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): p-r-1 warm-up forwards, then alternate, then drain backwards.

    Rank r holds at most p-r micro-batches' activations instead of m.
    """
    _check_sizes(p, m)
    compute = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [(_fwd(0, i),) for i in range(warm)]
        for i in range(m - warm):
            order += [(_fwd(0, warm + i),), (_bwd(0, i),)]
        order += [(_bwd(0, i),) for i in range(m - warm, m)]
        compute.append(order)
    return with_transfers("1f1b", p, m, 1, compute)


def interleaved_1f1b(p: int, m: int, v: int) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, micro-batches in groups of p.

    The k-th forward of a rank runs chunk ``(k // p) % v`` on micro-batch
    ``(k // (p*v)) * p + k % p``; backwards walk the chunks in reverse. Warm-up is
    ``2*(p-r-1) + (v-1)*p`` forwards (Megatron-LM's count), capped at ``m*v``.
    """
    _check_sizes(p, m, v)
    if m % p:
        raise ConfigError(
            f"interleaved_1f1b needs micro_batches ({m}) divisible by pipeline ranks ({p}); "
            f"set parallel.micro_batches to a multiple of {p}"
        )
    total = m * v

    def fwd(k: int) -> Instruction:
        return _fwd((k // p) % v, (k // (p * v)) * p + k % p)

    def bwd(k: int) -> Instruction:
        return _bwd(v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    compute = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [(fwd(k),) for k in range(warm)]
        # Steady state: a forward and a backward back to back, their four transfers in one
        # batch (strict-rendezvous deadlock freedom needs this pairing; the checker proves it).
        for i in range(total - warm):
            order.append((fwd(warm + i), bwd(i)))
        order += [(bwd(k),) for k in range(total - warm, total)]
        compute.append(order)
    return with_transfers("interleaved_1f1b", p, m, v, compute)



def zero_bubble(p: int, m: int) -> PipelineSchedule:
    """Zero bubble, ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each backward is
    split into its input-gradient half B, which the previous stage waits for, and its
    weight-gradient half W, which nothing waits for and so fills the time 1F1B leaves idle.

    Rank r runs p-r forwards (1F1B's warm-up and its first steady forward), then for each
    micro-batch its B, the oldest weight halves while more than r are pending, and its next F;
    then the weight halves left. So rank r keeps r weight halves back through the steady state:
    the last rank runs F B F B while the gradients travel back, and each rank's held-back weight
    halves fill the time it would wait at the end of the step for the last gradient. At most p-r
    micro-batches have run F but not B on rank r (as in 1F1B) and at most p have run F but not W
    (the activation memory of 1F1B's first rank, on every rank). With F = B = W = 1 unit every
    rank idles max(p-1, 2p-1-m) units: ZB-H1's (p-1)(F+B-W) once m >= p, against 1F1B's
    (p-1)(F+B+W). That is its timing under the runtime's transfer semantics too
    (:func:`chipset.runtime.pipeline.check.check_schedule`; a unit test compares them);
    ``chipset train --print-schedule`` shows the timeline for any shape.
    """
    _check_sizes(p, m)
    return with_transfers("zero_bubble", p, m, 1, [_h1_rank_order(p, m, r) for r in range(p)])


def _h1_rank_order(p: int, m: int, r: int) -> list[tuple[Instruction, ...]]:
    order: list[tuple[Instruction, ...]] = []

    def run(op: Op, mb: int) -> None:
        order.append((Instruction(op, mb, 0),))

    forwards, backwards, weights = min(p - r, m), 0, 0
    for mb in range(forwards):
        run(Op.FORWARD, mb)
    while backwards < m:
        run(Op.BACKWARD_INPUT, backwards)
        backwards += 1
        while backwards - weights > r:
            run(Op.BACKWARD_WEIGHT, weights)
            weights += 1
        if forwards < m:
            run(Op.FORWARD, forwards)
            forwards += 1
    for mb in range(weights, m):
        run(Op.BACKWARD_WEIGHT, mb)
    return order


def zbv(p: int, m: int) -> PipelineSchedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): zero bubble on two
    chunks per rank placed in a V (chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r).

    Rank 0 runs the first and the last virtual stage, so a micro-batch's backward starts on the
    rank its forward started on, and rank p-1 hands its chunk 0's output to its chunk 1 locally.
    Each chunk is half a rank's layers (F = B = W = 1 unit per chunk); the order is the paper's
    (:func:`_v_order`): every rank holds at most 2p chunk micro-batches between F and W (the
    activation memory of 1F1B's first rank), and once m >= (3p-1)/2 its only idle time is the first
    activation's way to the last rank, (p-1)/(6m) of the step. Sends are buffered (waited at the
    end of the step): neighbouring ranks send each other activations and gradients both ways.
    """
    _check_sizes(p, m)
    return with_transfers("zbv", p, m, 2, _v_order(p, m), "v", buffered_sends=True)


def _v_order(p: int, m: int) -> list[list[tuple[Instruction, ...]]]:
    """ZB-V's own order (the paper's, as torch's ``ScheduleZBVZeroBubble`` runs it), per rank r:
    warm-up with 2(p-r)-1 forwards of chunk 0, r pairs (F chunk 1, F chunk 0) and p-r triples
    (F, B, W of chunk 1); then F, B, W of chunk 0 and of chunk 1 in turn; then r pairs (B chunk
    0, B chunk 1), p-r pairs (B, W of chunk 0) and the weight halves left. Built for at least
    2p-1 micro-batches; the ones beyond m are dropped."""
    return [_v_rank_order(p, m, r) for r in range(p)]


def _v_rank_order(p: int, m: int, r: int) -> list[tuple[Instruction, ...]]:
    n = max(2 * p - 1, m)
    f, b, w = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    done = {(op, c): 0 for op in (f, b, w) for c in (0, 1)}
    order: list[tuple[Instruction, ...]] = []

    def run(*ops: tuple[Op, int]) -> None:
        for op, c in ops:
            mb = done[(op, c)]
            done[(op, c)] += 1
            if mb < m:
                order.append((Instruction(op, mb, c),))

    run(*[(f, 0)] * (2 * (p - r) - 1))
    run(*[(f, 1), (f, 0)] * r)
    run(*[(f, 1), (b, 1), (w, 1)] * (p - r))
    while done[(f, 1)] < done[(f, 0)] or done[(f, 0)] < n:
        if done[(f, 0)] < n:
            run((f, 0))
        run((b, 0), (w, 0), (f, 1), (b, 1), (w, 1))
    run(*[(b, 0), (b, 1)] * r)
    run(*[(b, 0), (w, 0)] * (p - r))
    run(*[(w, 1)] * (done[(b, 1)] - done[(w, 1)]))
    run(*[(w, 0)] * (done[(b, 0)] - done[(w, 0)]))
    return order


def make_schedule(name: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for p ranks, m micro-batches, v chunks."""
    if name == "gpipe":
        sched = gpipe(p, m)
    elif name == "1f1b":
        sched = one_f_one_b(p, m)
    elif name == "interleaved_1f1b":
        sched = interleaved_1f1b(p, m, v)
    elif name == "zero_bubble":
        sched = zero_bubble(p, m)
    elif name == "zbv":
        if v != 2:
            raise ConfigError(f"parallel.schedule = 'zbv' runs two model chunks per rank in a V; found "
                              f"parallel.virtual_stages = {v}: set parallel.virtual_stages=2")
        return zbv(p, m)
    else:
        raise ConfigError(f"parallel.schedule = {name!r}: expected one of {', '.join(SCHEDULES)}")
    if name != "interleaved_1f1b" and v != 1:
        raise ConfigError(
            f"parallel.virtual_stages = {v}: only interleaved_1f1b and zbv run several chunks per rank; "
            f"set parallel.virtual_stages=1 or parallel.schedule=interleaved_1f1b"
        )
    return sched
