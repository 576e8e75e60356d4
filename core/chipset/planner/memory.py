"""Per-device memory of one layout: model states by ZeRO stage, activations by recompute policy.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3 and 5; docs/formulas.md), mixed-precision
Adam with P = 2 bytes of parameters, G = 2 of gradients, K = 12 of optimizer state per
parameter, sharded over N = dp*cp ranks (dp*cp/ep for expert parameters):
stage 0 (P+G+K)Ψ = 16Ψ; stage 1 (P+G)Ψ + KΨ/N; stage 2 PΨ + (G+K)Ψ/N; stage 3 (P+G+K)Ψ/N.
ZeRO-3 also holds the gathered parameters of two blocks (the one computing, one prefetched).

Activations per block and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198, Sec. 4), generalised from
their GPT count to GQA, SwiGLU and MoE. For GPT (f = 4h, MHA, dropout) it is exactly
their sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor
parallelism and sbh/t (34 + 5as/h) with sequence parallelism; selective recompute drops
the 5as^2b attention-core term, full recompute keeps only the block input (2sbh, /t with
sequence parallelism). Context parallelism divides s by cp.

In flight at the first pipeline stage (Korthikanti et al. Sec. 4.2.3): GPipe all m
micro-batches, 1F1B min(p, m), interleaved 1F1B the warm-up of Megatron's schedule
2(p-1) + (v-1)p + 1 model chunks (capped at m*v) of l/(pv) blocks each, i.e. about
l(1 + (p-1)/(pv)) blocks' worth.

ZBV (Qi et al. 2024) places each rank's two chunks in a V, so rank 0 holds the embedding and the
head and rank p-1 turns the V round. Its positions are "ends" (rank 0) and "turn" (rank p-1, whose
chunk micro-batches in flight bound every middle rank's); rank r holds min(2p, 2m, m + r + 1)
chunk micro-batches of l/(2p) blocks at its peak, so no rank more than 1F1B's first (counted from
chipset's schedule, tests/planner). The planner models it when 2p divides the blocks.

With ``ModelSpec.kernels == "reference"`` the activations are those chipset's engine saves
with its pure-torch reference kernels (what cpu_sim runs), counted from the code and checked
tensor by tensor (docs/planner.md, "Validation: peak memory"), and the peak is the largest of
four moments of a step rather than a sum: the loss's backward (every in-flight activation
plus the cross-entropy's float32 work buffers), a block's backward (with what a recomputed
block holds meanwhile), the end of backward under ZeRO-2/3 (unsharded gradients waiting for their
reduce-scatter) and the optimizer step (float32 temporaries of one bucket, ZeRO-1/2 send
buffers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

from chipset.errors import ConfigError
from chipset.planner import memory_reference as ref
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import ModelSpec
from chipset.planner.stages import even_split, stage_block_counts

__all__ = ["MemoryBreakdown", "memory_per_device", "memory_per_stage", "zero_model_state_bytes",
           "block_activation_bytes", "stage_layers", "stage_blocks", "pipeline_positions", "in_flight_chunks",
           "params_per_device", "stage_expert_params"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the busiest device (the pipeline stage that needs the most)."""

    params: float
    """Parameters in the compute dtype (sharded as the ZeRO stage says)."""
    grads: float
    """Gradients."""
    optimizer: float
    """Optimizer state (fp32 master weights, Adam m and v)."""
    zero3_buffer: float
    """Gathered full parameters of the blocks in use (ZeRO-3 only)."""
    activations: float
    """Saved activations of every in-flight micro-batch, plus logits on the last stage."""
    workspace: float = 0.0
    """Short-lived buffers alive at the peak (reference kernels): the cross-entropy's backward, a
    block's backward, unsharded gradients before their reduce-scatter, optimizer temporaries."""
    phase: str = ""
    """The moment of the step the peak falls in (reference kernels): "loss backward",
    "block backward", "gradient reduce" or "optimizer step"; empty for fused kernels."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.zero3_buffer + self.activations + self.workspace


def zero_model_state_bytes(psi: float, n: int, zero: int, train: TrainSpec | None = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device for ``psi`` parameters sharded over ``n`` ranks."""
    train = train or TrainSpec()
    P, G, K = train.param_bytes, train.grad_bytes, train.optimizer_bytes
    if zero == 0:
        return P * psi, G * psi, K * psi
    if zero == 1:
        return P * psi, G * psi, K * psi / n
    if zero == 2:
        return P * psi, G * psi / n, K * psi / n
    if zero == 3:
        return P * psi / n, G * psi / n, K * psi / n
    raise ValueError(f"zero must be 0..3 (found {zero!r})")


def stage_layers(m: ModelSpec, lay: Layout) -> int:
    """Blocks on the busiest pipeline rank: l/p, or ⌈l/p⌉ when p does not divide l (stages.py)."""
    return max(stage_block_counts(m.layers, lay.pp))


def pipeline_positions(m: ModelSpec, lay: Layout) -> dict[str, tuple[int, int]]:
    """``{stage: (rank index, blocks)}`` of the pipeline positions the model tells apart: "only"
    without a pipeline, else "first" and "last" and, when p does not divide l (p >= 3), "middle":
    the earliest of the heavier middle ranks, which holds more blocks than the first and the
    last stage and more micro-batches in flight than any later rank."""
    if lay.pp == 1:
        return {"only": (0, m.layers)}
    if lay.schedule == "zbv":
        if m.layers % (2 * lay.pp):
            raise ConfigError(f"parallel.schedule = 'zbv' is planned when 2 x pp divides the blocks: {m.layers} blocks "
                              f"over {2 * lay.pp} virtual stages do not split evenly; plan with zero_bubble, or with a "
                              "number of blocks that 2 x pp divides")
        return {"ends": (0, m.layers // lay.pp), "turn": (lay.pp - 1, m.layers // lay.pp)}
    counts = stage_block_counts(m.layers, lay.pp)
    out = {"first": (0, counts[0])}
    if lay.pp >= 3 and not even_split(m.layers, lay.pp):
        heavy = max(counts)
        out["middle"] = next((i, heavy) for i in range(1, lay.pp - 1) if counts[i] == heavy)
    out["last"] = (lay.pp - 1, counts[-1])
    return out


def stage_blocks(m: ModelSpec, lay: Layout, stage: str | None = None) -> int:
    """Blocks on ``stage`` (a key of :func:`pipeline_positions`); None: the busiest rank's."""
    if stage is None:
        return stage_layers(m, lay)
    pos = pipeline_positions(m, lay)
    if stage not in pos:
        raise ValueError(f"stage {stage!r}: expected one of {', '.join(pos)} for pp={lay.pp}")
    return pos[stage][1]


def in_flight_chunks(lay: Layout, micro_batches: int, rank: int = 0) -> int:
    """Model chunks (each 1/v of a rank's blocks) whose activations pipeline rank ``rank`` (0: the
    first stage) holds at its peak: 1F1B min(p - rank, m), interleaved Megatron-LM's warm-up
    2(p - rank - 1) + (v - 1)p + 1 (at most m·v), GPipe m, zero bubble min(p, m) on every rank (a
    micro-batch's activations live until its deferred weight gradient), ZBV min(2p, 2m, m + rank + 1)."""
    p, v, mb = lay.pp, lay.v, micro_batches
    if p == 1:
        return 1
    if lay.schedule == "zbv":
        return min(2 * p, 2 * mb, mb + rank + 1)
    if lay.schedule == "gpipe":
        return mb
    if lay.schedule == "zero_bubble":
        return min(p, mb)
    if lay.schedule == "interleaved_1f1b":
        return min(mb * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    return min(p - rank, mb)


def params_per_device(m: ModelSpec, lay: Layout) -> tuple[dict[str, float], float]:
    """({stage: non-expert params}, expert params of the busiest rank) on one device of each pipeline
    position (:func:`pipeline_positions`)."""
    pos = tuple((k, b) for k, (_, b) in pipeline_positions(m, lay).items())
    stages, expert = _params_per_device(m, lay.tp, lay.ep, pos)
    return dict(stages), expert


def stage_expert_params(m: ModelSpec, lay: Layout, blocks: int) -> float:
    """Expert parameters on one device of a rank holding ``blocks`` blocks (0 for a dense model)."""
    expert_t = lay.tp if m.experts_split_over_tp else 1
    if not m.is_moe:
        return 0.0
    return blocks * (m.moe_layers / m.layers) * m.mlp_params() * (m.num_experts / lay.ep) / expert_t


@functools.lru_cache(maxsize=4096)  # the search asks the same question for every option of a layout
def _params_per_device(m: ModelSpec, t: int, ep: int, positions: tuple[tuple[str, int], ...]) -> tuple[tuple, float]:
    moe_frac = m.moe_layers / m.layers
    norms = 2 * m.norm_params()
    dense_block = (m.attention_params() + m.mlp_params()) / t + norms
    expert_t = t if m.experts_split_over_tp else 1
    moe_block = m.attention_params() / t + m.router_params() + m.shared_expert_params() / expert_t + norms
    blocks = max(b for _, b in positions)
    expert = blocks * moe_frac * m.mlp_params() * (m.num_experts / ep) / expert_t if m.is_moe else 0.0
    emb = m.vocab * m.hidden / t + (m.seq_len * m.hidden if m.position == "learned" else 0)
    one_rank = positions[0][0] in ("only", "ends")  # the embedding and the head on one rank
    out = m.norm_params() + m.vocab * m.hidden / t * (0 if (m.tied_embeddings and one_rank) else 1)
    edges = {"only": emb + out, "first": emb, "last": out, "middle": 0.0, "ends": emb + out, "turn": 0.0}
    stages = []
    for name, b in positions:
        non_expert = b * ((1 - moe_frac) * dense_block + moe_frac * moe_block)
        stages.append((name, non_expert + edges[name]))
    return tuple(stages), expert


def block_activation_bytes(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec | None = None) -> float:
    """Saved activation bytes of one block for one micro-batch on one device."""
    train = train or TrainSpec()
    if m.kernels == "reference":
        return _reference_block_bytes(m, lay, seq_len, train)
    b, h, t, a = lay.micro_batch, m.hidden, lay.tp, m.heads
    s_full = seq_len
    s = seq_len / lay.cp
    e = train.param_bytes / 2  # the Korthikanti constants assume 2-byte activations
    sp_div = t if lay.sp else 1
    if lay.recompute == "full":
        return 2 * e * s * b * h / sp_div
    r = m.kv / m.heads
    f = m.ffn
    drop = 1 if m.dropout else 0
    # Outside the tensor-parallel region: two norm inputs (4), QKV input (2), MLP input (2), dropout masks.
    replicated = (8 + 2 * drop) * s * b * h
    per_mlp = (6 if m.mlp == "swiglu" else 4) * s * b * f
    whole = 0.0  # experts replicated over tp run the whole sequence on every tp rank
    if m.is_moe:
        moe_frac = m.moe_layers / m.layers
        moe_mlp = m.top_k * (2 * s * b * h + per_mlp) + per_mlp * m.shared_ffn / f  # + the shared expert
        mlp = (1 - moe_frac) * per_mlp
        if m.experts_split_over_tp:
            mlp += moe_frac * moe_mlp
        else:
            whole = moe_frac * moe_mlp
        replicated += moe_frac * 4 * s * b * m.num_experts / e  # fp32 router logits
    else:
        mlp = per_mlp
    split = (2 * (1 + 2 * r) + 2) * s * b * h + mlp
    if m.flash_attention:
        core = 4 * a * s * b  # fp32 log-sum-exp per query row
    elif lay.recompute == "selective":
        core = 0.0
    else:
        core = (2 + 3 * drop) * a * s * s_full * b
    return e * (replicated / sp_div + split / t + whole) + core / t


def _edge_activation_bytes(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec) -> tuple[float, float]:
    """(first stage, last stage) extra activations: embedding output; final norm and fp32 logits."""
    b, h, t = lay.micro_batch, m.hidden, lay.tp
    s = seq_len / lay.cp
    sp_div = t if lay.sp else 1
    first = (train.param_bytes + (1 if m.dropout else 0)) * s * b * h / sp_div
    logit_tokens = ref.loss_tokens(lay, s * b, b)  # a chunked loss holds one chunk's logits
    last = 2 * train.param_bytes * s * b * h / sp_div + 4 * logit_tokens * m.vocab / t
    return first, last


def memory_per_device(m: ModelSpec, lay: Layout, train: TrainSpec, seq_len: int | None = None) -> MemoryBreakdown:
    """Peak bytes on the busiest device under ``lay`` for ``train``."""
    return max(memory_per_stage(m, lay, train, seq_len).values(), key=lambda b: b.total)


def memory_per_stage(m: ModelSpec, lay: Layout, train: TrainSpec,
                     seq_len: int | None = None) -> dict[str, MemoryBreakdown]:
    """Peak bytes per pipeline position (:func:`pipeline_positions`): ``{"only": ...}`` without
    pipeline, else ``"first"`` and ``"last"``, and ``"middle"`` when p does not divide l."""
    s = seq_len or m.seq_len
    micro_batches = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    stages, _ = params_per_device(m, lay)
    pos = pipeline_positions(m, lay)
    if m.kernels == "reference":
        return {stage: _reference_stage(m, lay, train, s, stage, pos[stage], stages[stage], micro_batches)
                for stage in stages}
    n_dense = lay.dp * lay.cp
    n_expert = max(1, n_dense // lay.ep)
    per_block = block_activation_bytes(m, lay, s, train)
    first_extra, last_extra = _edge_activation_bytes(m, lay, s, train)
    working = 0.0
    if lay.recompute != "none":
        # The block being recomputed holds its full activations during its backward.
        full = dataclasses.replace(lay, recompute="none")
        working = block_activation_bytes(m, full, s, train) - per_block
    if lay.offload_activations:  # saved activations on the host; the block in backward back on the device
        working, per_block = working + per_block, 0.0
    out = {}
    for stage, psi in stages.items():
        rank, blocks = pos[stage]
        expert = stage_expert_params(m, lay, blocks)
        p, g, o = zero_model_state_bytes(psi, n_dense, lay.zero, train)
        pe, ge, oe = zero_model_state_bytes(expert, n_expert, lay.zero, train)
        if lay.schedule == "zbv":  # rank 0's loss chunk runs its backward right after its forward
            act = per_block * (blocks / lay.v) * in_flight_chunks(lay, micro_batches, rank)
            if stage == "ends":
                act += first_extra * min(micro_batches, 2 * lay.pp) + last_extra
        elif stage == "last":  # 1F1B: the last stage runs each backward right after its forward
            act = per_block * blocks * (micro_batches if lay.schedule == "gpipe" else 1) + last_extra
        else:
            act = per_block * (blocks / lay.v) * in_flight_chunks(lay, micro_batches, rank)
            if stage != "middle":
                act += first_extra * min(micro_batches, lay.pp if lay.pp > 1 else 1)
            if stage == "only":
                act += last_extra
        act += working
        buf = 0.0
        if lay.zero == 3:
            block = (psi + expert) / max(1, blocks)
            buf = 2 * train.param_bytes * block
        out[stage] = MemoryBreakdown(params=p + pe, grads=g + ge, optimizer=o + oe, zero3_buffer=buf, activations=act)
    return out


# --- chipset's engine with its reference kernels (ModelSpec.kernels == "reference") ---------------


def _reference_block_bytes(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec) -> float:
    tokens = lay.micro_batch * seq_len / lay.cp
    return tokens * ref.block_bytes_per_token(m, lay, seq_len, train) + ref.mask_bytes(m, lay, seq_len)


def _reference_stage(m: ModelSpec, lay: Layout, train: TrainSpec, s: int, stage: str, position: tuple[int, int],
                     psi: float, micro_batches: int) -> MemoryBreakdown:
    """The largest of the step's four moments (module docstring) on one pipeline position
    (``position``: its rank index and blocks; ``psi``: its non-expert parameters)."""
    n_dense = lay.dp * lay.cp
    n_expert = max(1, n_dense // lay.ep)
    rank, blocks = position
    expert = stage_expert_params(m, lay, blocks)
    p, g, o = zero_model_state_bytes(psi, n_dense, lay.zero, train)
    pe, ge, oe = zero_model_state_bytes(expert, n_expert, lay.zero, train)
    states = MemoryBreakdown(params=p + pe, grads=g + ge, optimizer=o + oe, zero3_buffer=0.0, activations=0.0)
    e, gb = train.param_bytes, train.grad_bytes
    tokens = lay.micro_batch * s / lay.cp
    block = block_activation_bytes(m, lay, s, train)
    # A recomputed block holds what it recomputed (full: everything; selective: the attention core) meanwhile.
    redo = block_activation_bytes(m, dataclasses.replace(lay, recompute="none"), s, train) - block
    if lay.offload_activations:  # every block's saved tensors on the host; the one in backward back on the device
        redo, block = redo + block, 0.0
    # Where modelled, node by node instead: the block's saved tensors come back one node at a time.
    offloaded = ref.offloaded_block_backward_bytes(m, lay, tokens, train)
    loss_stage = stage in ("only", "last", "ends")
    embed = tokens * ref.embed_bytes_per_token(lay) if stage in ("only", "first", "ends") else 0.0
    logit_tokens = ref.loss_tokens(lay, tokens, lay.micro_batch)
    head = logit_tokens * ref.head_bytes_per_token(m, lay, train) if loss_stage else 0.0
    chunk_grads = 0.0
    if loss_stage and logit_tokens < tokens:  # the chunks' checkpoint keeps the head's input whole
        head += e * tokens * m.hidden
        # Its gradient in loss backward: the running sum and one chunk's slice gradient, both full-size.
        chunk_grads = 2 * e * tokens * m.hidden
    # Micro-batches whose activations are alive at the first backward: the first stage's warm-up; the
    # last stage runs each backward right after its forward except under GPipe.
    if stage == "last" and lay.schedule == "interleaved_1f1b":  # its other chunks warm up like the first rank's
        chunks = min(micro_batches * lay.v, (lay.v - 1) * lay.pp + 1)
    elif stage == "last" and lay.schedule != "zero_bubble":
        chunks = micro_batches * lay.v if lay.schedule == "gpipe" else 1
    else:
        chunks = in_flight_chunks(lay, micro_batches, rank)
    local = psi + expert
    # ZeRO-2/3 accumulate unsharded gradients locally from the first backward to the last micro-batch's.
    # They are complete from the second backward on, when one micro-batch fewer may be in flight: with
    # 1F1B the first stage has min(p, m-1) left (rank i: min(p - i, m - 1)), GPipe m-1; the interleaved
    # schedule is counted as if its warm-up were still in flight (an upper bound).
    accumulated = gb * local if lay.zero >= 2 and micro_batches > 1 else 0.0
    if stage == "only" or lay.schedule in ("interleaved_1f1b", "zero_bubble", "zbv") or stage == "last" and lay.schedule != "gpipe":
        later = chunks
    elif lay.schedule == "gpipe":
        later = chunks - lay.v
    else:
        later = min(lay.pp - rank, micro_batches - 1)
    z3 = e * local / max(1, blocks) if lay.zero == 3 else 0.0  # the block's gathered parameters
    if lay.zero == 3 and stage in ("middle", "last", "turn") and lay.schedule in ("zero_bubble", "zbv"):
        # An input half gathers each unit and its weight half releases it (the release waits for
        # the unit's gradients): between the two the whole stage is gathered. (ZBV's rank 0: its
        # first chunk has no input half, so one chunk, about the one block counted above.)
        z3 = e * local
    # Zero bubble: the other micro-batches alive have run their input half and keep the gradients
    # their weight half needs (not on the first stage, whose whole backward is its weight half).
    frontier = (tokens * ref.frontier_grad_bytes_per_token(m, lay, train, blocks, loss_stage)
                if lay.schedule == "zero_bubble" and stage in ("middle", "last") else 0.0)
    if lay.schedule == "zbv":  # one chunk's nodes
        frontier = tokens * ref.frontier_grad_bytes_per_token(m, lay, train, blocks // 2, loss_stage)
    moments = []

    def in_backward(alive: int, embedded: int, heads: int, kept: int, waiting: int, keeps: bool, loss: bool,
                    grads: float) -> None:
        """The loss's and a block's backward with ``alive`` chunk micro-batches holding activations,
        ``embedded`` embedding outputs, ``heads`` head activations, ``kept`` chunk outputs and
        ``waiting`` micro-batches' gradients kept for their weight half (split backward; by its
        end the input half in progress keeps its own too when ``keeps``)."""
        acts = block * blocks / lay.v * alive + embed * embedded + frontier * waiting
        stage_out = e * tokens * m.hidden * kept
        if loss:
            moments.append(("loss backward", acts + stage_out + head * heads,
                            logit_tokens * ref.loss_backward_bytes_per_token(m, lay) + grads + chunk_grads, 0.0))
        held = acts + stage_out + (head * (heads - 1) if loss else 0.0) + (frontier if keeps else 0.0)
        if offloaded is None:
            moments.append(("block backward", held + redo, ref.block_backward_bytes(m, lay, tokens, train) + grads, z3))
        else:
            moments.append(("block backward", held, offloaded + grads, z3))

    for alive, grads in ((chunks, 0.0), (later, accumulated)) if accumulated else ((chunks, 0.0),):
        if lay.schedule == "zbv":
            for state in _zbv_states(stage, lay.pp, micro_batches):
                in_backward(*state, grads)
            continue
        mbs = max(1, alive // lay.v) if lay.v > 1 else alive
        # Chunk outputs kept for their backward; a loss chunk's output is the loss (interleaved: one in flight).
        kept = alive - 1 if loss_stage and lay.v > 1 else 0 if loss_stage else alive
        in_backward(alive, mbs, mbs, kept, alive - 1, True, loss_stage, grads)
    if lay.schedule == "zbv":
        mbs = min(micro_batches, 2 * lay.pp) if stage == "ends" else 0
    else:
        mbs = max(1, chunks // lay.v) if lay.v > 1 else chunks
    bucket = train.bucket_mb * 2**20 / e if lay.zero < 3 else local / max(1, blocks)
    bucket = min(local, bucket)
    if lay.zero >= 2:  # every bucket's flattened gradient waits for its reduce-scatter until the step
        moments.append(("gradient reduce", embed * mbs, gb * local + gb * bucket, 0.0))
    shard = bucket if lay.zero == 0 else bucket / n_dense
    # ZeRO-1/2: each updated slice waits in a send buffer for its all-gather until every bucket is
    # updated, so the last full bucket's float32 temporaries meet the earlier buckets' send buffers.
    send = e * (local - bucket) / n_dense if lay.zero in (1, 2) and n_dense > 1 else 0.0
    # The reference AdamW's m/bc1 and v/bc2, plus a float32 copy of the gradient unless the
    # gradient already is float32 (then it is scaled in place, data_parallel.apply_update).
    temps = 2 if e == ref.F else 3
    moments.append(("optimizer step", 0.0, temps * ref.F * shard + send, 0.0))
    phase, act, work, buf = max(moments, key=lambda x: x[1] + x[2] + x[3])
    return dataclasses.replace(states, activations=act, workspace=work, zero3_buffer=buf, phase=phase)


class _ZbvState(NamedTuple):
    """What a ZBV rank holds at one of its input-gradient backwards (``in_backward``'s arguments)."""

    alive: int  # chunk micro-batches holding activations
    embedded: int  # embedding outputs
    heads: int  # head activations
    kept: int  # chunk outputs kept for their backward
    waiting: int  # micro-batches whose gradients wait for their weight half
    keeps: bool  # this input half keeps its gradients too
    loss: bool  # it is the loss's backward


@functools.lru_cache(maxsize=256)
def _zbv_states(stage: str, p: int, m: int) -> tuple[_ZbvState, ...]:
    """The states of a ZBV position at each of its input-gradient backwards, read off chipset's
    schedule for (p, m).
    Rank 0 ("ends") keeps its chunk 0's outputs (sent on) and its loss chunk's head; the turning
    rank keeps both chunks' outputs (one handed over locally, one sent back)."""
    from chipset.runtime.pipeline.schedules import Op, zbv

    rank = 0 if stage == "ends" else p - 1
    alive: dict[tuple[int, int], bool] = {}  # (chunk, micro-batch) -> its input half has run
    out = set()
    for ins in zbv(p, m).ranks[rank]:
        key = (ins.chunk, ins.mb)
        if ins.op == Op.FORWARD:
            alive[key] = False
        elif ins.op == Op.BACKWARD_INPUT:
            first = sum(1 for c, _ in alive if c == 0)
            # The input halves run so far keep their gradients for their weight halves (this one's
            # by its end); rank 0's first chunk has no input gradient (all weight half).
            keeps = stage != "ends" or ins.chunk == 1
            waiting = sum(done for (c, _), done in alive.items() if stage != "ends" or c == 1)
            if stage == "ends":
                out.add(_ZbvState(len(alive), first, len(alive) - first, first, waiting, keeps, ins.chunk == 1))
            else:
                out.add(_ZbvState(len(alive), 0, 0, len(alive), waiting, keeps, False))
            alive[key] = True
        elif ins.op in (Op.BACKWARD_WEIGHT, Op.BACKWARD):
            alive.pop(key)
    return tuple(sorted(out))
