"""Executing a pipeline schedule: one optimizer step = one pass over this rank's instructions.

:class:`PipelineEngine` holds this rank's pieces of the model (a
:class:`~chipset.parallel.stages.UnitStageModel`) wrapped in a
:class:`~chipset.runtime.data_parallel.DataParallel` over the dp dimension, so ZeRO,
bucketing, clipping, AdamW and mixed precision are the data-parallel engine's own.

Per step it interprets the schedule (checked by
:func:`~chipset.runtime.pipeline.check.check_schedule` when the engine is built):
FORWARD/BACKWARD run a chunk on a micro-batch; a run of consecutive transfers is posted
as one ``backend.collective.batch_p2p`` in the schedule's order and waited on as a whole; its
receives are posted one compute op ahead (before the forward or backward that precedes them),
so their data arrives while that op computes. Sends are waited one batch later, or, where the
schedule buffers them (ZBV), at the end of the step. Neighbouring virtual stages on one rank
(ZBV's turn) hand over a copy of the activation and get its gradient back without a transfer.

Loss: the last virtual stage computes each micro-batch's mean cross-entropy and
back-propagates ``loss * scale / m``, exactly as the single-process gradient-accumulation
loop does; every virtual stage whose units add an auxiliary loss (MoE load balancing:
``UnitStageModel.aux_loss``) adds it to its own backward the same way and to the micro-batch's
reported loss; the m losses (summed over stages) reach every pipeline rank through one
all-reduce over the pp group. Gradient norm and fp16 overflow are summed over the pp group too
(``DataParallel.norm_groups``), so clipping sees the whole model's norm.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from chipset.interfaces import P2POp
from chipset.parallel.dims import ParallelDims
from chipset.parallel.experts import expert_param_names
from chipset.parallel.stages import UnitSpec, UnitStageModel
from chipset.parallel.tensor import logical_slice
from chipset.runtime.data_parallel import DataParallel
from chipset.runtime.digest import combine
from chipset.runtime.pipeline.check import check_schedule
from chipset.runtime.pipeline.schedules import Instruction, Op, PipelineSchedule
from chipset.runtime.pipeline.split_backward import WeightGrad, backward_input
from chipset.runtime.precision import compute_input
from chipset.runtime.trace import trace_range

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["PipelineEngine"]

_RANGE = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "backward_input",
          Op.BACKWARD_WEIGHT: "backward_weight"}


class PipelineEngine:
    """One pipeline rank: its chunks, their data-parallel engine, and the schedule it runs.

    Use: ``losses = pe.forward_backward_step(batches)`` (a list of m (tokens, targets)),
    then ``pe.step(lr)``. ``pe.full_parameters()`` returns the whole model's parameters by
    their single-process names on every rank (collective over the pp group).
    """

    def __init__(self, bound, backend: Backend, dims: ParallelDims, schedule: PipelineSchedule,
                 specs: list[UnitSpec], **dp_kwargs):
        model = bound.module  # bound: the model and its family (chipset.models.family.BoundModel)
        self.backend = backend
        self.collective = backend.collective
        self.dims = dims
        self.schedule = schedule
        self.sim = check_schedule(schedule)  # refuse a broken schedule before anything runs
        p, v = schedule.stages, schedule.virtual_stages
        if len(specs) != p * v:
            raise ValueError(f"{len(specs)} stage specs for {p} ranks x {v} chunks")
        col = self.collective
        self.pp_group = dims.group("pp", col)
        self.pp_rank = self.pp_group.ranks.index(col.rank())
        self.specs = specs
        self.my_specs = [specs[schedule.virtual_stage(self.pp_rank, c)] for c in range(v)]
        self.unit_shapes = bound.unit_shapes
        self._shapes: dict[tuple, list[torch.Size]] = {}
        # Logical (single-process) shape of every parameter of the whole model: a checkpoint
        # written or read by one stage is checked against all of it (checkpoint/layout.py).
        # ep-sharded experts hold E/ep rows of their logical [E, ...] tensors.
        experts = expert_param_names(model) if dims.ep_enabled else set()
        self.model_shapes = {n: tuple(s[3]) if (s := logical_slice(t)) else
                             (t.shape[0] * dims.ep, *t.shape[1:]) if n in experts else tuple(t.shape)
                             for n, t in model.named_parameters()}
        # Every rank learns every parameter's name, shape and owning stage (for full_parameters).
        self._owners: list[list[tuple[str, torch.Size]]] = [[] for _ in range(p)]
        for r in range(p):
            sm = UnitStageModel(bound, [specs[schedule.virtual_stage(r, c)] for c in range(v)])
            self._owners[r] = [(n, t.shape) for n, t in sm.named_parameters()]
        # runs of the family's chain of units (parallel/stages.py)
        self.model = UnitStageModel(bound, self.my_specs)
        # The units other ranks hold move to the meta device: this rank keeps none of their
        # memory, although ``model`` (still referenced by its family's bound methods) lives on.
        held = {id(m) for m in self.model.modules()}
        for unit in bound.pipeline_units():
            if id(unit) not in held:
                unit.to("meta")
        # Stages exchange hidden states as this rank holds them: its cp share of each sequence
        # and, with sequence parallelism, its tp slice of that (tp ranks send only their slice).
        sp = any(getattr(getattr(mod, "tp", None), "sequence_parallel", False) for mod in model.modules())
        self.seq_shards = dims.cp * (dims.tp if sp else 1)
        self.engine = DataParallel(self.model, backend, dims, **dp_kwargs)
        self.engine.norm_groups = [self.pp_group]
        self.instructions = schedule.ranks[self.pp_rank]
        # ZBV's turn: the chunk whose input (output gradient) is another chunk's of this rank.
        self._local_prev = {c: schedule.local_neighbour(self.pp_rank, c, -1) for c in range(v)}
        self.compute_delay: tuple[float, float] = (0.0, 0.0)
        """Seconds slept after each forward/backward (benchmarks and the bubble test make compute dominate)."""
        self.timings: list[tuple[Instruction, float, float]] = []
        """Last step: (compute instruction, start, end) in ``time.perf_counter`` seconds."""

    # --- what the trainer reads off a data-parallel engine ----------------------------------
    @property
    def dp(self) -> int:
        return self.engine.dp

    @property
    def dp_rank(self) -> int:
        return self.engine.dp_rank

    @property
    def group(self):
        return self.engine.group

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def scaler(self):
        return self.engine.scaler

    @property
    def launch_log(self):
        return self.engine.launch_log

    @property
    def buckets(self):
        """This rank's gradient/optimizer buckets; their parameter names are single-process names."""
        return self.engine.buckets

    @property
    def zero(self) -> int:
        return self.engine.zero

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step: the schedule's."""
        return self.schedule.micro_batches

    @property
    def optimizer(self):
        """The injected optimizer (runtime/optim.py) every stage's buckets update with."""
        return self.engine.optimizer

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of this rank's parameters."""
        return self.engine.dtype

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (a checkpoint restores it)."""
        return self.engine.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.engine.step_count = value

    def state_dict(self) -> dict:
        """This rank's training state (``DataParallel.state_dict``) plus which stages it holds."""
        return {**self.engine.state_dict(), "pp": self.schedule.stages, "pp_rank": self.pp_rank,
                "virtual_stages": [s.virtual_stage for s in self.my_specs]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output written under the same layout and split."""
        from chipset.errors import UsageError

        mine = (self.schedule.stages, self.pp_rank, [s.virtual_stage for s in self.my_specs])
        theirs = (state.get("pp"), state.get("pp_rank"), state.get("virtual_stages"))
        if mine != theirs:
            raise UsageError(f"pipeline state was written for (pp, pp_rank, virtual stages) {theirs}, this rank "
                             f"is {mine}; load it through a resharding checkpoint instead")
        self.engine.load_state_dict(state)

    # --- one step --------------------------------------------------------------------------
    def _vs(self, chunk: int) -> int:
        return self.schedule.virtual_stage(self.pp_rank, chunk)

    def _boundary_shape(self, inputs: torch.Tensor, vs: int, leaving: bool) -> tuple[int, ...]:
        """Shape of the activation entering (or, ``leaving``, leaving) virtual stage ``vs`` for
        a micro-batch ``inputs``: the family's unit output shape (found once per input shape on
        the meta device), its sequence dimension (1) divided among cp ranks and, with sequence
        parallelism, tp ranks: each sends only the share it holds."""
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._shapes:
            self._shapes[key] = self.unit_shapes(inputs)
        spec = self.specs[vs]
        shape = list(self._shapes[key][(spec.last if leaving else spec.first) - 1])
        if self.seq_shards > 1:
            shape[1] //= self.seq_shards
        return tuple(shape)

    def forward_backward_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                              loss_factor: float = 1.0) -> list[float]:
        """Run the schedule over ``batches`` (one (tokens, targets) per micro-batch); the m losses,
        each times ``loss_factor`` (1.0 but for an injected loss spike), as in backward."""
        s, e = self.schedule, self.engine
        m, last_vs = s.micro_batches, s.num_virtual - 1
        if len(batches) != m:
            raise ValueError(f"schedule expects {m} micro-batches, got {len(batches)}")
        e.begin_accumulation(sync=False)
        if self.seq_shards > 1:
            seq_len = batches[0][0].shape[1]
            if seq_len % self.seq_shards:
                raise ValueError(f"sequence length {seq_len} is not divisible by cp*tp(sequence parallel) = "
                                 f"{self.seq_shards}")
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        grads_out: dict[tuple[int, int], torch.Tensor] = {}
        aux_out: dict[tuple[int, int], torch.Tensor] = {}  # scaled MoE aux losses of non-last stages
        # Each micro-batch's loss terms on this rank, kept as detached scalars and summed once
        # after the schedule (_sum_losses): no indexing or in-place add between a stage's
        # compute and its next hand-off.
        loss_parts: list[list[torch.Tensor]] = [[] for _ in range(m)]
        scale = self.scaler.scale / m
        # With one chunk, the final backward (or, split, the final weight half) is the last time
        # every bucket fills: launch the gradient communication during it (overlap). With
        # several, buckets span chunks whose last backwards interleave, so communication starts
        # after the last one.
        final_backward = max(i for i, ins in enumerate(self.instructions)
                             if ins.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT))
        overlap = s.virtual_stages == 1
        split = any(ins.op is Op.BACKWARD_INPUT for ins in self.instructions)  # zero-bubble halves
        deferred: dict[tuple[int, int], WeightGrad] = {}  # zero bubble: weight halves still to run
        self.timings = []
        # The transfers since the last compute op: (op, buffer, the receive's handle; None for a send).
        batch: list[tuple[Instruction, torch.Tensor, object]] = []

        # Sends in flight: (handle, tensor). A send is waited one flush later (or at the end of
        # the step), not right away: on gloo a send completes only once the peer has posted the
        # matching receive, so waiting at once stalled this stage on the peer's compute.
        # Receives are waited at once (their data is used next). Keeping the tensor referenced
        # keeps its storage alive until the send is done; numerics are unchanged.
        sends: list[tuple[object, torch.Tensor]] = []
        peers = self.pp_group.ranks
        # Receives are posted one compute op ahead: {instruction index: (handle, buffer)}. The
        # receives that follow a compute op in the schedule are posted before it runs (those before
        # the first, at the start), so their data arrives during it instead of after it (on gloo a
        # transfer starts once both sides have posted); each is waited where the schedule has it,
        # and each peer's receives keep the schedule's order.
        ahead: dict[int, tuple[object, torch.Tensor]] = {}

        def post_receives(i: int) -> None:
            """Post the receives between instruction ``i`` and the next compute op."""
            recvs = []
            for j in range(i + 1, len(self.instructions)):
                nxt = self.instructions[j]
                if nxt.op.is_compute:
                    break
                if nxt.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    shape = self._boundary_shape(batches[nxt.mb][0], self._vs(nxt.chunk), nxt.op is Op.RECV_GRAD)
                    recvs.append((j, nxt, torch.empty(shape, dtype=e.dtype, device=self.device)))
            handles = self.collective.batch_p2p([P2POp("recv", t, peers[nxt.peer]) for _, nxt, t in recvs])
            for h, (j, _, t) in zip(handles, recvs, strict=True):
                ahead[j] = (h, t)

        def flush() -> None:
            if not batch:
                return
            posted = self.collective.batch_p2p(
                [P2POp("send", t, peers[ins.peer]) for ins, t, h in batch if h is None])
            for _, _, h in batch:
                if h is not None:
                    h.wait()
            if not s.buffered_sends:  # else every send is waited at the end of the step
                for h, _ in sends:
                    h.wait()
                sends.clear()
            sends.extend(zip(posted, (t for _, t, h in batch if h is None), strict=True))
            for ins, t, _ in batch:
                key = (ins.chunk, ins.mb)
                if ins.op is Op.RECV_ACT:
                    inputs[key] = t.requires_grad_(True)
                elif ins.op is Op.RECV_GRAD:
                    grads_in[key] = t
            batch.clear()

        post_receives(-1)
        for i, ins in enumerate(self.instructions):
            key = (ins.chunk, ins.mb)
            if ins.op is Op.SEND_ACT:
                batch.append((ins, outputs[key].detach().contiguous(), None))
                continue
            if ins.op is Op.SEND_GRAD:
                batch.append((ins, grads_out.pop(key).contiguous(), None))
                continue
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                h, t = ahead.pop(i)
                batch.append((ins, t, h))
                continue
            flush()
            post_receives(i)
            t0 = time.perf_counter()
            vs = self._vs(ins.chunk)
            # A profiler range per stage op (closed after the timing below; no-op unless profiling).
            stage_range = trace_range(f"chipset::stage{vs}.{_RANGE[ins.op]}")
            stage_range.__enter__()
            prev_local = self._local_prev[ins.chunk]
            if ins.op is Op.FORWARD:
                tokens, targets = batches[ins.mb]
                if prev_local is not None:  # handed over on this rank: a copy, as a transfer would make
                    inputs[key] = outputs[(prev_local, ins.mb)].detach().clone().requires_grad_(True)
                x = self.model.local(compute_input(tokens, e.dtype)) if vs == 0 else inputs[key]
                with e.gathered_saved_weights(split):  # ZeRO-3: saved weights re-gathered in backward
                    out = self.model.chunk_forward(ins.chunk, x)
                aux = self.model.aux_loss(ins.chunk)  # MoE: each stage adds its layers' aux loss
                if aux is not None and loss_factor != 1.0:
                    aux = aux * loss_factor
                if vs == last_vs:
                    loss = self.model.loss(out, self.model.local(targets))
                    if loss_factor != 1.0:
                        loss = loss * loss_factor
                    if aux is not None:
                        loss = loss + aux
                    loss_parts[ins.mb].append(loss.detach().float())
                    out = loss.float() * scale
                elif aux is not None:
                    loss_parts[ins.mb].append(aux.detach().float())
                    aux_out[key] = aux.float() * scale
                outputs[key] = out
                delay = self.compute_delay[0]
            elif ins.op is Op.BACKWARD_WEIGHT:
                if overlap and i == final_backward:
                    e.begin_accumulation(sync=True)
                deferred.pop(key).run()
                delay = self.compute_delay[1] / 2
            elif ins.op is Op.BACKWARD_INPUT:
                out = outputs.pop(key)
                roots, grads = [out], [None if vs == last_vs else grads_in.pop(key)]
                if key in aux_out:
                    roots.append(aux_out.pop(key))
                    grads.append(None)
                dx, deferred[key] = backward_input(roots, grads, inputs.pop(key) if vs > 0 else None)
                if prev_local is not None:
                    grads_in[(prev_local, ins.mb)] = dx
                elif vs > 0:
                    grads_out[key] = dx
                delay = self.compute_delay[1] / 2
            else:
                if overlap and i == final_backward:
                    e.begin_accumulation(sync=True)
                out = outputs.pop(key)
                if vs == last_vs:
                    out.backward()
                elif key in aux_out:
                    torch.autograd.backward([out, aux_out.pop(key)], [grads_in.pop(key), None])
                else:
                    out.backward(grads_in.pop(key))
                if prev_local is not None:
                    grads_in[(prev_local, ins.mb)] = inputs.pop(key).grad
                elif vs > 0:
                    grads_out[key] = inputs.pop(key).grad
                delay = self.compute_delay[1]
            if delay:
                time.sleep(delay)
            self.timings.append((ins, t0, time.perf_counter()))
            stage_range.__exit__(None, None, None)
            # Drop this op's references: a split backward keeps its graph (retain_graph) for the weight
            # half, and its input-path nodes' saved tensors live until nothing holds the graph's roots.
            out = x = loss = aux = roots = grads = dx = None
        flush()
        for h, _ in sends:
            h.wait()
        sends.clear()
        e.release_units()  # any unit still gathered (gradient arrival releases most)
        if not overlap:
            e.start_grad_sync()
        e.sync = True
        losses = self._sum_losses(loss_parts)
        if s.stages > 1:
            self.collective.all_reduce(losses, "sum", group=self.pp_group)
        return [float(x) for x in losses.tolist()]

    def _sum_losses(self, loss_parts: list[list[torch.Tensor]]) -> torch.Tensor:
        """The m micro-batch losses of this rank as one float32 tensor: each micro-batch's terms
        added in the order the schedule produced them, 0 where this rank has none."""
        if not any(loss_parts):
            return torch.zeros(len(loss_parts), dtype=torch.float32, device=self.device)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        sums = []
        for parts in loss_parts:
            total = parts[0] if parts else zero
            for part in parts[1:]:
                total = total + part
            sums.append(total)
        return torch.stack(sums)

    def step(self, lr: float) -> dict:
        """Finish gradient communication, clip over the whole model, update (DataParallel.step)."""
        return self.engine.step(lr)

    # --- inspection ------------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, float32 on the host, by its single-process name.

        Collective over the pp group (each stage broadcasts what it holds); checkpoints and
        ``params_digest`` use this to see one logical model whatever the split.
        """
        mine = self.engine.full_parameters()
        if self.schedule.stages == 1:
            return mine
        out = {}
        for r, owned in enumerate(self._owners):
            # Logical shapes come from the owner: tensor parallelism shards what this rank saw.
            dims = torch.tensor([d for n, _ in owned for d in (mine[n].shape if r == self.pp_rank else ())]
                                or [0] * sum(len(shape) for _, shape in owned), dtype=torch.int64, device=self.device)
            self.collective.broadcast(dims, self.pp_group.ranks[r], group=self.pp_group)
            it = iter(dims.tolist())
            owned = [(n, torch.Size([next(it) for _ in shape])) for n, shape in owned]
            numels = [shape.numel() for _, shape in owned]
            if r == self.pp_rank:
                flat = torch.cat([mine[n].reshape(-1) for n, _ in owned]).to(self.device)
            else:
                flat = torch.empty(sum(numels), dtype=torch.float32, device=self.device)
            self.collective.broadcast(flat, self.pp_group.ranks[r], group=self.pp_group)
            flat = flat.to("cpu")
            off = 0
            for (n, shape), k in zip(owned, numels, strict=True):
                out[n] = flat[off:off + k].view(shape).clone()
                off += k
        return out

    @torch.no_grad()
    def param_hashes(self) -> dict[str, bytes]:
        """Name -> per-parameter hash of the whole model (runtime/digest.py): each stage hashes
        what it holds, bucket by bucket, and the 32-byte hashes are exchanged over the pp group,
        so no rank ever holds another stage's parameters (collective)."""
        mine = self.engine.param_hashes()
        if self.schedule.stages == 1:
            return mine
        out = {}
        for r, owned in enumerate(self._owners):
            names = [n for n, _ in owned]
            if r == self.pp_rank:
                raw = b"".join(mine[n] for n in names)
                flat = torch.frombuffer(bytearray(raw), dtype=torch.int64).to(self.device)
            else:
                flat = torch.empty(4 * len(names), dtype=torch.int64, device=self.device)
            self.collective.broadcast(flat, self.pp_group.ranks[r], group=self.pp_group)
            raw = flat.to("cpu").numpy().tobytes()
            out.update({n: raw[32 * i:32 * (i + 1)] for i, n in enumerate(names)})
        return out

    def iter_full_parameters(self):
        """``(name, tensor)`` of this rank's stages, unsharded one bucket at a time (collective
        over the stage's dp, tp and ep groups; other stages' parameters are not included)."""
        return self.engine.iter_full_parameters()

    def params_digest(self) -> str:
        """The layout-independent digest of the whole model (collective; runtime/digest.py)."""
        return combine(self.param_hashes())

    def owners(self) -> dict[str, int]:
        """Parameter name -> the pipeline rank holding it."""
        return {n: r for r, owned in enumerate(self._owners) for n, _ in owned}
