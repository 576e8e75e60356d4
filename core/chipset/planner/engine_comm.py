"""The planner's communication of an engine run, in the units the engine's accounting counts.

``Collective.comm_stats`` (written per step into ``metrics.jsonl`` as ``comm``) counts, per
rank and op, the bytes of the tensors handed to each call: the whole buffer of an
all-reduce, a reduce-scatter's input (the full buffer S), an all-gather's input (the local
shard, S/n), an all-to-all's input (the tokens this rank sends, to itself included) and,
for ``batch_p2p``, every send *and* receive buffer. :func:`planned_bytes` turns
:func:`~chipset.planner.comm.communication` for one pipeline stage into those units.

The planner models the reference algorithms (Megatron-LM's tensor parallelism, ZeRO as
published, ring attention), which is what its published-run comparison needs.
:func:`departures` lists, with a reason each, where chipset's engine moves other bytes;
every entry follows from the config alone, never from a measurement. planner +
departures is :func:`predict`, compared exactly with the simulator's counts by
benchmarks/comm_volume.py and tests/planner/test_planner_validation_comm.py (docs/planner.md,
"Validation against the engine").

Covered: dp (ZeRO 0-3), tp with and without sequence parallelism, pp <= 2 (first and last
stages; no middle stage), ep, cp (allgather and ring), their combinations, and
``train.recompute = "none"``. Bucket padding is modelled for one bucket per
parameter group (models under ``parallel.bucket_mb``) and per ZeRO-3 unit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from chipset.interfaces.device import DeviceProperties
from chipset.planner.cluster import Cluster
from chipset.planner.comm import CommItem, communication
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import params_per_device, stage_blocks
from chipset.planner.model import ModelSpec
from chipset.planner.run import from_run_config

__all__ = ["Departure", "ENGINE_OPS", "planner_inputs", "stage_of", "planned_bytes", "departures", "predict"]

ENGINE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "batch_p2p")
"""The engine's op names that carry training traffic (``metrics.OPS`` lists every one)."""

# Only group placement (intra/inter node) depends on the cluster; bytes do not.
_CLUSTER_DEVICE = DeviceProperties(name="engine-comm", index=0, total_memory=1)


@dataclass(frozen=True)
class Departure:
    """Bytes per rank and step the engine moves beyond (or short of) the planner's count."""

    op: str
    """Engine op name (see :data:`ENGINE_OPS`)."""
    bytes: float
    """Signed: positive where the engine sends more than the planner counts."""
    why: str
    """What the engine does differently."""


def planner_inputs(cfg: Any) -> tuple[ModelSpec, Layout, TrainSpec]:
    """The planner's model, layout and training spec for an engine RunConfig (``validate()``d).

    :func:`~chipset.planner.run.from_run_config` (micro-batch ``global_batch / (dp *
    micro_batches)`` sequences; parameters, gradients and activations in the compute dtype),
    with the vocabulary padded to a multiple of tp as the engine pads it.
    """
    par, tr = cfg.parallel, cfg.train
    if tr.recompute != "none":
        raise ValueError(f"train.recompute = {tr.recompute!r}: the engine comparison covers 'none' only "
                         "(recomputation reruns collectives the planner counts differently)")
    if par.dp < 1:
        raise ValueError("parallel.dp is 0: call cfg.validate(world_size=...) first so dp is filled in")
    m, lay, train = from_run_config(cfg)
    return dataclasses.replace(m, vocab=math.ceil(m.vocab / par.tp) * par.tp), lay, train


def stage_of(cfg: Any, rank: int) -> str:
    """The planner's stage name for ``rank``: "only" without pipelining, else "first" or "last"
    ("ends" or "turn" under ZBV)."""
    par = cfg.parallel
    if par.pp == 1:
        return "only"
    if par.pp > 2:
        raise ValueError(f"parallel.pp = {par.pp}: the engine comparison covers first and last stages (pp <= 2)")
    per_stage = par.dp * par.cp * par.tp  # pp is the outermost dimension of the rank order
    if par.schedule == "zbv":
        return "ends" if rank < per_stage else "turn"
    return "first" if rank < per_stage else "last"


def _engine_units(item: CommItem, cp_attention: str) -> dict[str, float]:
    """One planner item as the engine's accounting counts it."""
    n, total = item.group_size, item.buffer * item.calls
    if item.op == "send" or (item.dim == "cp" and item.op == "all_gather" and cp_attention in ("ring", "hybrid")):
        return {"batch_p2p": 2 * item.bytes}  # every byte sent is a byte received by the peer
    if item.op == "all_gather":
        return {"all_gather": total / n}
    return {item.op: total}


def planned_bytes(cfg: Any, stage: str) -> dict[str, float]:
    """``{engine op: bytes per rank and step}`` of :func:`communication` on ``stage``."""
    m, lay, train = planner_inputs(cfg)
    out: dict[str, float] = {}
    for item in communication(m, lay, train, Cluster(1, lay.world_size, _CLUSTER_DEVICE), stage=stage):
        for op, v in _engine_units(item, cfg.parallel.cp_attention).items():
            out[op] = out.get(op, 0.0) + v
    return out


def departures(cfg: Any, stage: str) -> list[Departure]:
    """Where the engine's bytes on ``stage`` differ from the planner's, each with its reason."""
    m, lay, train = planner_inputs(cfg)
    par = cfg.parallel
    E = train.param_bytes
    mb, b, h, t = par.micro_batches, lay.micro_batch, m.hidden, lay.tp
    s = m.seq_len // lay.cp
    L = stage_blocks(m, lay, stage)
    first, last = stage in ("only", "first", "ends"), stage in ("only", "last", "ends")
    act = E * b * s * h
    out: list[Departure] = []

    def add(op: str, nbytes: float, why: str) -> None:
        if nbytes:
            out.append(Departure(op, float(nbytes), why))

    # --- data parallel ------------------------------------------------------------------
    stages, expert = params_per_device(m, lay)
    n_rep = lay.dp * lay.cp
    for psi, n, kind in ((stages[stage], n_rep, "dense"), (expert, n_rep // lay.ep, "expert")):
        if n <= 1 or psi <= 0:
            continue
        pad = _padding(m, lay, stage, psi, n, kind)
        if lay.zero == 0:
            add("all_reduce", pad * E, f"{kind} gradient bucket padded to a multiple of {n} ranks")
        elif lay.zero == 1:
            add("all_reduce", (psi + pad) * E, "ZeRO-1 all-reduces the whole gradient (a reduce-scatter would do)")
            add("reduce_scatter", -psi * E, "ZeRO-1 all-reduces the whole gradient (a reduce-scatter would do)")
            add("all_gather", pad * E / n, f"{kind} bucket padded to a multiple of {n} ranks")
        elif lay.zero == 2:
            add("reduce_scatter", pad * E - (mb - 1) * psi * E,
                "ZeRO-2 accumulates micro-batches unsharded and reduce-scatters once per step")
            add("all_gather", pad * E / n, f"{kind} bucket padded to a multiple of {n} ranks")
        else:
            add("reduce_scatter", pad * E - (mb - 1) * psi * E,
                "ZeRO-3 accumulates micro-batches unsharded and reduce-scatters once per step")
            emb = m.vocab * h / t if first and kind == "dense" else 0
            add("all_gather", 2 * mb * pad * E / n - mb * (emb + _pad(emb, n)) * E / n,
                "ZeRO-3 does not re-gather the embedding for backward (its gradient needs only the token ids)")
    # --- per-step scalars -----------------------------------------------------------------
    if n_rep > 1:
        add("all_reduce", 4, "loss averaged over the replicas (one float32)")
    if lay.pp > 1:
        add("all_reduce", 4 * mb, "micro-batch losses summed over the pipeline stages (float32 each)")
    norm_groups = (lay.zero >= 1 and n_rep > 1) + (t > 1) + (lay.pp > 1)
    add("all_reduce", 8 * norm_groups, "gradient norm and overflow flag summed over dp, tp and pp (2 x float32)")
    if lay.ep > 1 and lay.zero == 0:
        add("all_reduce", 4, "expert gradients' squared norm summed over ep (float32)")
    # --- tensor parallel ------------------------------------------------------------------
    # The blocks' projections move what Megatron-LM's do (the planner's count): q, k, v and
    # gate, up each share one entry into the tp region (parallel/tensor.py, TPRegionNorm).
    if t > 1:
        if lay.sp:
            norms = 2 * L + (1 if last else 0)
            add("all_reduce", mb * norms * h * E,
                "sequence-parallel norm weights' gradients all-reduced over tp every micro-batch")
        if last:
            add("all_reduce", 12 * b * s * mb,
                "vocabulary-parallel cross-entropy: max, sum of exponentials and target logit per token (float32)")
    # --- expert parallel ------------------------------------------------------------------
    if lay.ep > 1:
        moe_blocks = math.ceil(L * m.moe_layers / m.layers)
        add("all_to_all", 8 * m.num_experts * moe_blocks * mb, "routing counts exchanged before each dispatch (int64)")
    # --- context parallel -----------------------------------------------------------------
    if lay.cp > 1:
        kv_local = 2 * E * b * s * max(m.kv_dim / t, m.head_dim)  # this rank's K and V
        n = lay.cp
        if par.cp_attention == "ring":
            engine = 2 * (n - 1) * kv_local + (4 * (n - 1) + 2) * kv_local * 4 / E  # fwd, bwd in float32
            planner = 2 * 3 * (n - 1) * kv_local
            add("batch_p2p", (engine - planner) * L * mb,
                "ring attention: a last hop brings dK, dV home (and backward blocks travel in float32)")
        elif par.cp_attention == "allgather":
            add("all_gather", -2 * kv_local * L * mb,
                "cp_attention=allgather: one all-gather of K, V forward, not the three ring passes the planner counts")
            add("reduce_scatter", n * kv_local * L * mb,
                "cp_attention=allgather: K, V gradients reduce-scattered back to their owners in backward")
    # --- pipeline -------------------------------------------------------------------------
    if lay.pp > 1 and t > 1 and not lay.sp:  # with sp each tp rank holds, and sends, only its slice
        sends = (2 if lay.schedule == "zbv" else 2 * lay.v - 1) * mb
        add("batch_p2p", 2 * sends * act * (t - 1) / t,
            "every tp rank sends the whole activation (without sequence parallelism no rank holds only a slice)")
    return out


def _pad(x: float, n: int) -> float:
    return math.ceil(x / n) * n - x


def _padding(m: ModelSpec, lay: Layout, stage: str, psi: float, n: int, kind: str) -> float:
    """Padding elements of the buckets of ``psi`` parameters over ``n`` ranks."""
    if lay.zero < 3 or kind == "expert":
        return _pad(psi, n)  # one bucket (the model is under parallel.bucket_mb)
    # ZeRO-3: one bucket per unit: embedding, each block, head.
    t = lay.tp
    emb = m.vocab * m.hidden / t if stage in ("only", "first", "ends") else 0
    head = m.norm_params() + m.vocab * m.hidden / t if stage in ("only", "last", "ends") else 0
    blocks = stage_blocks(m, lay, stage)
    block = (psi - emb - head) / blocks
    return _pad(emb, n) + _pad(head, n) + blocks * _pad(block, n)


def predict(cfg: Any, rank: int) -> dict[str, float]:
    """``{engine op: bytes}`` rank ``rank`` moves per step: planner plus departures.

    all_to_all bytes of one rank depend on routing (the tokens its experts receive); their
    mean over the ep group is what is predicted.
    """
    stage = stage_of(cfg, rank)
    out = {op: 0.0 for op in ENGINE_OPS}
    for op, v in planned_bytes(cfg, stage).items():
        out[op] += v
    for d in departures(cfg, stage):
        out[d.op] += d.bytes
    return out
