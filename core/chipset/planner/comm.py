"""Communication per step per collective, and where each group's ranks sit.

Volumes are bytes one rank sends, ring algorithms (docs/formulas.md): all-reduce 2(n-1)/n·S,
reduce-scatter and all-gather (n-1)/n·S each, all-to-all (n-1)/n·S, point-to-point S.
Time of one call is latency·steps + bytes / bandwidth, with 2(n-1) latency steps for a
ring all-reduce, n-1 for reduce-scatter, all-gather and all-to-all, 1 for a send.

Placement follows the rank order in :mod:`chipset.planner.layout` (tp innermost, then cp,
ep, dp, pp outermost). A group of n ranks with stride st lies inside one node when
st·n <= devices per node and divides it; otherwise it uses the inter-node bandwidth
(each device's own share of the node's network).

What is sent, per device and step (b micro-batch, s/cp local sequence, m micro-batches):
- dp (over dp*cp ranks; experts over dp*cp/ep): ZeRO-0 one all-reduce of the gradients;
  ZeRO-1 a reduce-scatter of gradients and an all-gather of updated parameters; ZeRO-2
  the reduce-scatter every micro-batch (gradients are kept sharded) and one all-gather;
  ZeRO-3 per micro-batch an all-gather before forward, another before backward and a
  reduce-scatter of gradients (Rajbhandari et al. 2020, Sec. 7: 1.5x the data-parallel volume).
- tp (Shoeybi et al. 2019; Korthikanti et al. 2022): per block and micro-batch 2 all-reduces
  forward and 2 backward of b·s·h activations (with sequence parallelism each becomes a
  reduce-scatter plus an all-gather, the same bytes), 2 more when a full recompute reruns
  the forward (1 in a dense model whose recompute stops early, before the MLP's output
  projection); per micro-batch 1 more for the embedding (forward) and 1 for the output
  layer's input gradient (backward): both without pipelining, one on a first or last stage,
  none on a middle one.
- ep: per MoE block and micro-batch 4 all-to-alls (dispatch and combine, forward and
  backward; 6 with full recompute) of the top_k copies of the local tokens.
- cp (ring attention, Liu et al. 2023): per block and micro-batch K and V go round the
  ring forward, again backward with their gradients: 3x (4x with full recompute) an
  all-gather of the local K, V. Ulysses (Jacobs et al. 2023): per block and micro-batch
  four all-to-alls forward (q, k, v to the head split, the output back; kv heads repeated
  up to a multiple of cp) and four backward (six each way with full recompute).
- pp: per micro-batch and model chunk one activation forward and one gradient backward,
  b·s·h/t bytes (Narayanan et al. 2021 scatter/gather optimisation), plus an all-reduce of
  the tied embedding's gradient between the first and last stage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from chipset.planner.cluster import Cluster
from chipset.planner.kernels import recompute_stops_early
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import params_per_device, stage_blocks, stage_expert_params
from chipset.planner.model import ModelSpec

__all__ = ["CommItem", "bytes_by_collective", "data_parallel_items", "ring_bytes", "latency_steps", "group_stride",
           "is_intra_node", "communication", "stage_micro_items"]


def ring_bytes(op: str, size: float, n: int) -> float:
    """Bytes one rank sends for collective ``op`` over ``n`` ranks on a ``size``-byte buffer."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * size
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * size
    if op == "send":
        return float(size)
    raise ValueError(f"unknown collective {op!r}")


def latency_steps(op: str, n: int) -> int:
    """Sequential message steps of the ring algorithm (each pays one latency)."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else 1 if op == "send" else n - 1


def group_stride(lay: Layout, dim: str) -> int:
    """Distance in rank ids between neighbours of a ``dim`` group (see layout's rank order)."""
    return {"tp": 1, "cp": lay.tp, "ep": lay.tp, "dp": lay.tp * lay.cp,
            "pp": lay.tp * lay.cp * lay.dp}[dim]


def is_intra_node(n: int, stride: int, devices_per_node: int) -> bool:
    """True when every group of ``n`` ranks spaced ``stride`` apart fits inside one node."""
    span = n * stride
    return n <= 1 or (span <= devices_per_node and devices_per_node % span == 0)


@dataclass(frozen=True)
class CommItem:
    """One kind of collective in one step, on one device."""

    dim: str
    """Parallel dimension whose group runs it: dp, tp, ep, cp or pp."""
    op: str
    """all_reduce, reduce_scatter, all_gather, all_to_all or send."""
    what: str
    """What travels (gradients, parameters, activations, tokens, kv)."""
    group_size: int
    """Ranks in the group."""
    calls: int
    """Calls per step."""
    bytes: float
    """Bytes this device sends per step, all calls together (ring volume)."""
    intra_node: bool
    """The group lies inside one node."""
    time_s: float
    """Latency·steps·calls + bytes / bandwidth."""
    phase: str = ""
    """When it runs, for overlap: "grad" (end of backward), "param" (before forward),
    "micro" (every micro-batch, inside the pipeline), "step" (once, exposed)."""
    buffer: float = 0.0
    """Bytes of one call's whole buffer (S in the ring formulas; for an all-gather, the output)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _item(cl: Cluster, lay: Layout, dim: str, op: str, what: str, n: int, size: float, calls: int,
          phase: str, stride: int = 0) -> CommItem | None:
    """``stride``: rank distance within the group when it is not ``dim``'s own (hybrid cp's ring)."""
    if n <= 1 or calls <= 0 or size <= 0:
        return None
    intra = is_intra_node(n, stride or group_stride(lay, dim), cl.devices_per_node)
    d = cl.device
    bw = d.intra_node_bandwidth if intra else d.inter_node_bandwidth
    lat = d.intra_node_latency if intra else d.inter_node_latency
    vol = ring_bytes(op, size, n) * calls
    t = calls * latency_steps(op, n) * lat + (vol / bw if bw > 0 else 0.0)
    return CommItem(dim=dim, op=op, what=what, group_size=n, calls=calls, bytes=vol, intra_node=intra,
                    time_s=t, phase=phase, buffer=float(size))


ZERO3_REUSE_PARAMS = 1e9
"""Parameters a ZeRO-3 implementation keeps gathered between a block's recomputed forward
and its backward (DeepSpeed's ``stage3_max_reuse_distance`` default). A block larger than
this under full recompute is gathered three times per micro-batch (forward, recompute,
backward) instead of twice."""


def data_parallel_items(lay: Layout, train: TrainSpec, cl: Cluster, dense: float, expert: float,
                        mb: int, regather: bool = False) -> list[CommItem]:
    """The ZeRO-stage collectives for ``dense`` parameters over dp*cp ranks and ``expert`` over
    dp*cp/ep; ``regather``: ZeRO-3 gathers again for the recomputed forward."""
    P, G = train.param_bytes, train.grad_bytes
    out: list[CommItem | None] = []
    for psi, n, what in ((dense, lay.dp * lay.cp, ""), (expert, lay.dp * lay.cp // lay.ep, " (experts)")):
        if lay.zero == 0:
            out.append(_item(cl, lay, "dp", "all_reduce", "gradients" + what, n, G * psi, 1, "grad"))
        elif lay.zero == 1:
            out.append(_item(cl, lay, "dp", "reduce_scatter", "gradients" + what, n, G * psi, 1, "grad"))
            out.append(_item(cl, lay, "dp", "all_gather", "parameters" + what, n, P * psi, 1, "param"))
        elif lay.zero == 2:
            out.append(_item(cl, lay, "dp", "reduce_scatter", "gradients" + what, n, G * psi, mb, "grad_micro"))
            out.append(_item(cl, lay, "dp", "all_gather", "parameters" + what, n, P * psi, 1, "param"))
        else:
            # FP8 all-gather: the projection weights (a share of the dense ones) at 1 byte each
            f = train.fp8_gather_fraction if not what else 0.0
            ag = (P * (1 - f) + f) * psi
            out.append(_item(cl, lay, "dp", "all_gather", "parameters (forward)" + what, n, ag, mb, "param_micro"))
            out.append(_item(cl, lay, "dp", "all_gather", "parameters (backward)" + what, n, ag, mb, "grad_micro"))
            if regather:
                out.append(_item(cl, lay, "dp", "all_gather", "parameters (recompute)" + what, n, ag, mb,
                                 "grad_micro"))
            out.append(_item(cl, lay, "dp", "reduce_scatter", "gradients" + what, n, G * psi, mb, "grad_micro"))
    return [i for i in out if i is not None]


def communication(m: ModelSpec, lay: Layout, train: TrainSpec, cl: Cluster,
                  seq_len: int | None = None, stage: str | None = None) -> list[CommItem]:
    """Every collective one device runs in one step: on the busiest stage, or with ``stage``
    ("only" without pipelining, "first", "last" or, when p does not divide l, "middle", as in
    ``params_per_device``) on that one. The busiest stage is a bound over the stages: the most
    parameters, the most blocks, an edge stage's tensor-parallel calls and a middle stage's sends."""
    mb = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    stages, expert = params_per_device(m, lay)
    if stage is not None and stage not in stages:
        raise ValueError(f"stage {stage!r}: expected one of {', '.join(stages)} for pp={lay.pp}")
    dense = max(stages.values()) if stage is None else stages[stage]
    if stage is not None:
        expert = stage_expert_params(m, lay, stage_blocks(m, lay, stage))
    block_params = max(m.layer_params(False), m.layer_params(True) if m.is_moe else 0)
    regather = lay.zero >= 3 and lay.recompute == "full" and block_params > ZERO3_REUSE_PARAMS
    out: list[CommItem | None] = list(data_parallel_items(lay, train, cl, dense, expert, mb, regather))
    # embedding forward, output layer backward: both without a pipeline, one on an edge stage; ZBV's
    # rank 0 (also the busiest, stage None) runs both, its other ranks neither
    zbv = lay.schedule == "zbv" and lay.pp > 1
    if lay.pp == 1:
        edges = 2
    elif zbv:
        edges = 0 if stage == "turn" else 2
    else:
        edges = 0 if stage == "middle" else 1
    out += stage_micro_items(m, lay, train, cl, seq_len, stage_blocks(m, lay, stage), edges)

    # --- pipeline -----------------------------------------------------------------------
    if lay.pp > 1:
        s = (seq_len or m.seq_len) / lay.cp
        act = train.param_bytes * lay.micro_batch * s * m.hidden
        # A middle stage sends every chunk's activation on and its gradient back; the first
        # stage's first chunk sends no gradient, the last stage's last chunk no activation.
        if zbv:  # rank 0's two end chunks send one each, the turning rank hands one over locally
            sends = 2 * mb if stage in ("ends", "turn") or lay.pp == 2 else 4 * mb
        else:
            sends = 2 * mb * lay.v - (mb if stage in ("first", "last") else 0)
        out.append(_item(cl, lay, "pp", "send", "activations", lay.pp, act / lay.tp, sends, "micro"))
        if m.tied_embeddings and not zbv:  # ZBV holds both on rank 0
            emb = train.grad_bytes * m.vocab * m.hidden / lay.tp
            out.append(_item(cl, lay, "pp", "all_reduce", "tied embedding gradients", 2, emb, 1, "step"))
    return [i for i in out if i is not None]


def stage_micro_items(m: ModelSpec, lay: Layout, train: TrainSpec, cl: Cluster, seq_len: int | None,
                      blocks: int, edges: int) -> list[CommItem]:
    """The tp, ep and cp collectives of one step on a stage of ``blocks`` blocks that runs ``edges``
    of the embedding's forward and the output layer's backward tp calls (module doc)."""
    s = (seq_len or m.seq_len) / lay.cp
    b, h, t, P = lay.micro_batch, m.hidden, lay.tp, train.param_bytes
    mb = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    out: list[CommItem | None] = []

    # --- tensor parallel ----------------------------------------------------------------
    act = P * b * s * h
    per_block = 6 if lay.recompute == "full" else 4
    if recompute_stops_early(m, lay, train) and m.dense_layers == m.layers:
        per_block = 5  # the recompute stops before the MLP's output projection and its all-reduce
    calls = (blocks * per_block + edges) * mb
    if lay.sp:
        out.append(_item(cl, lay, "tp", "all_gather", "activations", t, act, calls, "micro"))
        out.append(_item(cl, lay, "tp", "reduce_scatter", "activations", t, act, calls, "micro"))
    else:
        out.append(_item(cl, lay, "tp", "all_reduce", "activations", t, act, calls, "micro"))

    # --- expert parallel ----------------------------------------------------------------
    if m.is_moe:
        moe_blocks = math.ceil(blocks * m.moe_layers / m.layers)
        tokens = P * b * s * h * m.top_k / (t if lay.sp else 1)
        a2a = (6 if lay.recompute == "full" else 4) * moe_blocks * mb
        out.append(_item(cl, lay, "ep", "all_to_all", "tokens", lay.ep, tokens, a2a, "micro"))

    # --- context parallel ---------------------------------------------------------------
    if lay.cp_attention in ("ulysses", "hybrid"):  # q, k, v to the head split and the output back; as many in backward
        u = lay.cp if lay.cp_attention == "ulysses" else lay.cp_ulysses
        kv_heads = max(1, round(m.kv_dim / m.head_dim / t))
        kv_width = math.lcm(kv_heads, u) * m.head_dim  # kv heads repeated up to a multiple of u
        mean = P * b * s * (2 * h / t + 2 * kv_width) / 4  # one call's buffer, averaged over the four
        calls = (12 if lay.recompute == "full" else 8) * blocks * mb
        out.append(_item(cl, lay, "cp", "all_to_all", "q, k, v, out", u, mean, calls, "cp"))
        if lay.cp_attention == "ulysses":
            return [i for i in out if i is not None]
        # hybrid: the ring over cp/u groups passes the head-split K/V of u ranks' tokens (the whole
        # sequence's K/V on kv_width/u per token), ranks u * (cp stride) apart
        kv = 2 * P * b * (seq_len or m.seq_len) * kv_width / u
        rounds = (4 if lay.recompute == "full" else 3) * blocks * mb
        out.append(_item(cl, lay, "cp", "all_gather", "kv (ring across Ulysses groups)", lay.cp // u, kv, rounds,
                         "cp", stride=group_stride(lay, "cp") * u))
        return [i for i in out if i is not None]
    kv = 2 * P * b * (seq_len or m.seq_len) * max(m.kv_dim / t, m.head_dim)
    rounds = (4 if lay.recompute == "full" else 3) * blocks * mb
    out.append(_item(cl, lay, "cp", "all_gather", "kv", lay.cp, kv, rounds, "cp"))
    return [i for i in out if i is not None]


def bytes_by_collective(items: list[CommItem]) -> dict[tuple[str, str], float]:
    """``{(dim, op): bytes sent per step}``: the shape the simulator's measured counters are compared in."""
    out: dict[tuple[str, str], float] = {}
    for i in items:
        out[(i.dim, i.op)] = out.get((i.dim, i.op), 0.0) + i.bytes
    return out
