"""Step time of one layout: compute, pipeline bubble, exposed communication, optimizer.

Per micro-batch on the slowest stage:
  compute = stage FLOPs / (peak · eff) + memory-bound bytes / memory bandwidth, where
  eff = gemm_efficiency · d / (d + gemm_half_dim), d = min(M, N, K) of each GEMM, both from
  the device profile where it declares them (matmul_efficiency, matmul_half_dim), else
  from Assumptions; peak is train.dtype's, and with train.fp8 on the FP8 peak for the
  attention and MLP projections only (kernels.py); MFU stays relative to train.dtype's peak;
  plus tp all-reduces, ep all-to-alls and pipeline sends, which sit on the critical path,
  plus ring-attention K/V traffic beyond what attention compute hides.
  The slowest stage is the last (its blocks plus the head) or, when p does not divide l, the
  slower of the last (⌊l/p⌋ blocks and the head) and the first stage with ⌈l/p⌉ blocks (stages.py).
Pipeline: (m + (p-1)/v) micro-batch slots, i.e. a bubble of (p-1)/m for GPipe and 1F1B
and (p-1)/(v·m) for interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2); when v does not
divide the slowest stage's c blocks, each of the p-1 bubble slots also holds the ⌈c/v⌉ - c/v
blocks by which its largest chunk exceeds 1/v of them. Zero bubble leaves max(p-1, 2p-1-m)/3 of a
slot idle (ZB-H1's (p-1)/3 once m >= p), ZBV max(p-1, 4p-2-2m)/6: (p-1)/6 once m >= (3p-1)/2 (Qi et
al. 2023, 2024; docs/formulas.md); both are the runtime's schedules' simulated idle time, exactly.
Data parallel: gradient reduction overlaps the last micro-batch's backward, the parameter
all-gather the first micro-batch's forward; ZeRO-3's per-micro-batch gathers overlap each
micro-batch's forward and backward. Only the excess is exposed.
Optimizer: the Adam update is memory-bound: a fused one reads and writes P+G+K bytes per
local (sharded) parameter, an unfused one ``TrainSpec.update_bytes``, at the achievable
fraction of memory bandwidth.
Launches: no micro-batch is faster than its kernels can be issued (kernels x the profile's
kernel launch latency), nor the update than its per-step kernels; every step also pays the
profile's host overhead. Both are negligible for large models and dominate tiny ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chipset.errors import ConfigError
from chipset.parallel.schedule import bubble_fraction as schedule_bubble
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster
from chipset.planner.comm import CommItem, communication, stage_micro_items
from chipset.planner.flops import forward_flops_per_token, model_flops_per_token, step_flops
from chipset.planner.kernels import (
    FP8_PEAK_KEYS,
    device_fp8_peak,
    device_stage_compute,
    gemm_curve,
    stage_compute,
)
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import (
    MemoryBreakdown,
    block_activation_bytes,
    memory_per_device,
    params_per_device,
    pipeline_positions,
    stage_layers,
)
from chipset.planner.model import ModelSpec
from chipset.planner.stages import largest_chunk, stage_block_counts

__all__ = ["Prediction", "dp_exposed_time", "evaluate", "gemm_efficiency", "launch_floor", "bubble_fraction",
           "optimizer_time"]


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one layout on one cluster."""

    layout: Layout
    """The layout evaluated."""
    micro_batches: int
    """Micro-batches per step per pipeline (m)."""
    memory: MemoryBreakdown
    """Bytes on the busiest device."""
    memory_limit_bytes: float
    """Usable device memory (capacity x memory_usable_fraction)."""
    step_time_s: float
    """Predicted seconds per optimizer step."""
    tokens_per_s: float
    """Global batch tokens / step time."""
    tflops_per_device: float
    """Executed FLOP/s per device in TFLOP/s, recompute included (Narayanan et al.'s measure)."""
    mfu: float
    """Model FLOPs utilisation (PaLM: 6N + 12LHQT per token, no recompute) of the bf16 peak."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per component: compute, tp, ep, cp, pp, bubble, dp_exposed, optimizer..."""
    comm: tuple[CommItem, ...] = ()
    """Every collective of the step on the busiest device (tp, ep and cp: the slowest stage's)."""
    stage_blocks: tuple[int, ...] = ()
    """Blocks on each pipeline rank, first to last (stages.py: ⌊l/p⌋ on the first and last when p
    does not divide l)."""
    slowest_stage: str = ""
    """The pipeline position whose micro-batch slot sets the pace: "only", "first", "middle" or "last"
    ("ends" under ZBV: rank 0, with the embedding and the head)."""
    bubble_slots: float = 0.0
    """The bubble in slots of the slowest stage: (p-1)/v, more when its blocks split unevenly over its
    chunks; max(p-1, 2p-1-m)/3 for zero_bubble, max(p-1, 4p-2-2m)/6 for zbv (their schedules', exactly)."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit_bytes

    def to_json(self) -> dict:
        """The documented JSON shape of one candidate."""
        lay = self.layout
        return {
            "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "zero": lay.zero,
            "micro_batch": lay.micro_batch, "schedule": lay.schedule_label, "recompute": lay.recompute,
            "memory_per_device_bytes": int(self.memory.total), "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
        }


def gemm_efficiency(m: ModelSpec, lay: Layout, seq_len: int, a: Assumptions,
                    train: TrainSpec | None = None, dev=None) -> float:
    """Fraction of peak the stage's projection, MLP and logit GEMMs reach together (the
    FLOP-weighted result of each GEMM's own roofline, kernels.py)."""
    train = train or TrainSpec()
    peak = dev.peak_flops_for(train.dtype) if dev is not None else 1e15
    bw = dev.memory_bandwidth if dev is not None else 0.0
    e_max, half = gemm_curve(dev, a)
    fp8 = device_fp8_peak(dev) if dev is not None and train.fp8 != "off" else 0.0
    sc = stage_compute(m, lay, seq_len, train, 1, peak, bw, a, e_max, a.attention_efficiency, half_dim=half,
                       fp8_peak=fp8)
    return sc.gemm_efficiency(peak)


def launch_floor(blocks: int, recompute: str, a: Assumptions) -> int:
    """Kernels one micro-batch of a stage launches: forward, twice as many in backward, and
    the forward again under full recompute (selective recompute re-runs only attention)."""
    per_block = a.kernels_per_block_forward * (3 + {"none": 0, "selective": 0.1, "full": 1}[recompute])
    return int(round(blocks * per_block))


def bubble_fraction(pp: int, micro_batches: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle pipeline time over ideal time: the runtime's formula (one declaration,
    :func:`chipset.parallel.schedule.bubble_fraction`): (p-1)/m, (p-1)/(v·m) interleaved,
    max(p-1, 2p-1-m)/(3m) zero bubble, max(p-1, 4p-2-2m)/(6m) ZBV."""
    return schedule_bubble(pp, micro_batches, v, schedule)


def _sum(items: list[CommItem], *, dim: str | None = None, phase: str | None = None) -> float:
    return sum(i.time_s for i in items if (dim is None or i.dim == dim) and (phase is None or i.phase == phase))


def overlapped(comm: float, work: float, contention: float) -> float:
    """Seconds ``comm`` and ``work`` take when they run concurrently: the longer of the two,
    plus ``contention`` times the overlapped span (the collective's kernels take multiprocessors
    and memory bandwidth from the compute running beside them, and vice versa)."""
    return max(comm, work) + contention * min(comm, work)


def dp_exposed_time(dp_items: list[CommItem], w_f: float, w_b: float, mb: int, a: Assumptions,
                    blocks: float = 0.0) -> float:
    """Data-parallel time not hidden: end-of-step traffic against one micro-batch's backward
    (gradients) or forward (parameters); per-micro-batch traffic (ZeRO-3's gathers and
    reduce-scatters) against every micro-batch's. Hidden traffic still slows the compute beside
    it (``Assumptions.overlap_contention``); ZeRO-3 cannot prefetch the first block's
    parameters of each pass behind anything: 1/``blocks`` of each per-micro-batch gather is exposed."""
    grad = _sum(dp_items, phase="grad")
    param = _sum(dp_items, phase="param")
    grad_micro = _sum(dp_items, phase="grad_micro") / mb
    param_micro = _sum(dp_items, phase="param_micro") / mb
    if not a.dp_overlap:
        return grad + param + mb * (grad_micro + param_micro)
    c = a.overlap_contention

    def exposed(comm: float, work: float, fill: float = 0.0) -> float:
        if comm <= 0:
            return 0.0
        head = comm * fill  # gathered before any compute can start
        return head + overlapped(comm - head, work, c) - work

    fill = 1 / blocks if blocks >= 1 else 0.0
    return (exposed(grad, w_b) + exposed(param, w_f)
            + mb * (exposed(grad_micro, w_b, fill) + exposed(param_micro, w_f, fill)))


def optimizer_time(train: TrainSpec, params: float, bandwidth: float, a: Assumptions) -> float:
    """Seconds the update of ``params`` local parameters takes: memory-bound, moving
    ``train.update_bytes`` per parameter (2(P + G + K) for a fused update) at the achievable
    fraction of the memory bandwidth (``Assumptions.memory_efficiency``); 0 without a bandwidth."""
    if bandwidth <= 0:
        return 0.0
    per_param = train.update_bytes or 2 * (train.param_bytes + train.grad_bytes + train.optimizer_bytes)
    return per_param * params / (bandwidth * a.memory_efficiency)


def evaluate(m: ModelSpec, lay: Layout, train: TrainSpec, cl: Cluster,
             assumptions: Assumptions | None = None, seq_len: int | None = None,
             memory: MemoryBreakdown | None = None) -> Prediction:
    """Predict memory and step time of ``lay`` (no validity filtering: see search for that).

    ``memory`` skips recomputing a breakdown the caller already has for the same inputs.
    """
    a = assumptions or Assumptions()
    lay.check()
    if lay.pp > m.layers:
        raise ConfigError(f"pp ({lay.pp}) must be at most layers ({m.layers}): every pipeline stage needs a block")
    s = seq_len or m.seq_len
    dev = cl.device
    peak = dev.peak_flops_for(train.dtype)
    if peak <= 0:
        raise ConfigError(f"device profile {cl.profile or dev.name!r} declares no peak FLOP/s for {train.dtype}; "
                          f"it declares: {', '.join(dev.peak_flops) or 'none'}. Choose another --dtype or profile.")
    if train.fp8 != "off" and device_fp8_peak(dev) <= 0:
        raise ConfigError(f"train.fp8 = {train.fp8!r}: device profile {cl.profile or dev.name!r} declares no FP8 peak "
                          f"FLOP/s ({' or '.join(FP8_PEAK_KEYS)}; it declares: {', '.join(dev.peak_flops) or 'none'}); "
                          "plan with train.fp8 = \"off\" (--fp8 off) or a profile that declares one")
    mb = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    fw = forward_flops_per_token(m, s)
    extra = {"none": 0, "selective": fw.attention_core, "full": fw.blocks}[lay.recompute]
    launch = dev.kernel_launch_latency or a.kernel_launch_latency
    fwd_share = fw.total / (3 * fw.total + extra)  # recompute runs inside backward
    bwd_share = 1 - fwd_share

    items = communication(m, lay, train, cl, s)
    t_pp = _sum(items, dim="pp", phase="micro") / mb
    # Every stage runs one slot per micro-batch; the slowest sets the pace of all of them.
    slowest = None
    for stage, blocks, logits, edges in _stage_kinds(m, lay):
        slot = _slot(m, lay, train, cl, a, s, blocks, logits, edges, mb, t_pp)
        if slowest is None or slot[0] > slowest[0][0]:
            slowest = (slot, stage, blocks)
    (t_slot, sc, t_gemm, t_mem, t_launch, t_compute, micro, t_tp, t_ep, t_cp), stage, blocks = slowest
    eff = sc.gemm_efficiency(peak)
    # The bubble: p - 1 times the slowest stage's largest chunk, 1/v of its slot when v divides its
    # blocks; else 1/v of the slot plus the blocks its largest chunk holds beyond 1/v of them.
    if lay.schedule in ("zero_bubble", "zbv"):  # the schedule's own idle time, exactly
        bubble = t_slot * mb * schedule_bubble(lay.pp, mb, lay.v, lay.schedule)
    elif blocks % lay.v == 0:
        bubble = t_slot * (lay.pp - 1) / lay.v
    else:
        t_block = _slot(m, lay, train, cl, a, s, 1, False, 0, mb, t_pp)[0] - t_pp
        bubble = (lay.pp - 1) * (t_slot / lay.v + (largest_chunk(blocks, lay.v) - blocks / lay.v) * t_block)
    t_pipeline = t_slot * mb + bubble
    items = ([i for i in items if i.dim not in ("tp", "ep", "cp", "pp")] + micro
             + [i for i in items if i.dim == "pp"])

    dp_items = [i for i in items if i.dim == "dp"]
    dp_exposed = dp_exposed_time(dp_items, t_compute * fwd_share, t_compute * bwd_share, mb, a, blocks)
    t_step_comm = _sum(items, phase="step")

    stages, expert = params_per_device(m, lay)
    dense = max(stages.values())
    n = lay.dp * lay.cp
    shard = dense / n + expert / max(1, n // lay.ep) if lay.zero >= 1 else dense + expert
    t_opt = max(optimizer_time(train, shard, dev.memory_bandwidth, a), a.kernels_per_step * launch)
    t_host = dev.step_host_overhead or a.step_host_overhead
    t_offload = offload_bytes(m, lay, train, s) / a.host_link_bandwidth
    step = t_pipeline + dp_exposed + t_step_comm + t_opt + t_host + t_offload
    n_dev = lay.world_size
    tokens = train.global_batch * s
    hw = step_flops(m, train.global_batch, lay.recompute, s)
    model = model_flops_per_token(m, s) * tokens
    mem = memory or memory_per_device(m, lay, train, s)
    return Prediction(
        layout=lay, micro_batches=mb, memory=mem, memory_limit_bytes=dev.total_memory * a.memory_usable_fraction,
        step_time_s=step, tokens_per_s=tokens / step, tflops_per_device=hw / step / n_dev / 1e12,
        mfu=model / step / n_dev / peak,
        breakdown={"compute": t_compute * mb, "gemm_efficiency": eff, "tp": t_tp * mb, "ep": t_ep * mb,
                   "cp_exposed": t_cp * mb, "pp": t_pp * mb, "bubble": bubble, "dp_total": _sum(dp_items),
                   "dp_exposed": dp_exposed, "step_comm": t_step_comm, "optimizer": t_opt,
                   "roofline": (t_gemm + t_mem) * mb, "launch_floor": t_launch * mb,
                   "host": t_host, "offload": t_offload},
        comm=tuple(items), stage_blocks=stage_block_counts(m.layers, lay.pp), slowest_stage=stage,
        bubble_slots=bubble / t_slot if t_slot > 0 else 0.0,
    )


def offload_bytes(m: ModelSpec, lay: Layout, train: TrainSpec, s: int) -> float:
    """Bytes per step and device that activation offload moves between device and host: every
    block's saved activations out in forward and back in backward, per micro-batch."""
    if not lay.offload_activations:
        return 0.0
    mb = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    blocks = max(stage_block_counts(m.layers, lay.pp))
    return 2 * block_activation_bytes(m, lay, s, train) * blocks * mb


def _slot(m: ModelSpec, lay: Layout, train: TrainSpec, cl: Cluster, a: Assumptions, s: int, blocks: int,
          logits: bool, edges: int, mb: int, t_pp: float) -> tuple:
    """One micro-batch's slot on a stage of ``blocks`` blocks (with the head when ``logits``, ``edges``
    embedding/output tp calls): (slot s, StageCompute, GEMM + attention s, memory-bound s, launch floor s,
    compute s, its tp/ep/cp items, tp s, ep s, exposed cp s)."""
    dev = cl.device
    sc = device_stage_compute(m, lay, s, train, blocks, dev, a, with_logits=logits)
    t_gemm, t_mem = sc.gemm_s + sc.attention_s, sc.memory_s
    t_launch = launch_floor(blocks, lay.recompute, a) * (dev.kernel_launch_latency or a.kernel_launch_latency)
    t_compute = max(t_gemm + t_mem, t_launch)
    micro = stage_micro_items(m, lay, train, cl, s, blocks, edges)
    t_tp = _sum(micro, dim="tp") / mb
    t_ep = _sum(micro, dim="ep") / mb
    t_cp = _sum(micro, dim="cp") / mb
    if a.cp_overlap and lay.cp_attention in ("ring", "hybrid"):  # the ring's hops hide behind the steps
        ring = sum(i.time_s for i in micro if i.dim == "cp" and i.op == "all_gather") / mb
        t_cp = t_cp - ring + max(0.0, ring - sc.attention_s)
    t_slot = t_compute + t_tp + t_ep + t_pp + t_cp
    return t_slot, sc, t_gemm, t_mem, t_launch, t_compute, micro, t_tp, t_ep, t_cp


def _stage_kinds(m: ModelSpec, lay: Layout) -> list[tuple[str, int, bool, int]]:
    """(stage, blocks, logits, edge tp calls) of each pipeline position that may be the slowest:
    the last (the head's GEMMs and loss) and, when p does not divide l, the first heavier one (the
    first stage when only the last is lighter, else a middle one). A lighter first stage is never
    slower than the last: as many blocks and edge calls, no head."""
    if lay.pp == 1:
        return [("only", m.layers, True, 2)]
    pos = pipeline_positions(m, lay)
    if lay.schedule == "zbv":  # rank 0 holds the head and as many blocks as the turning rank
        return [("ends", pos["ends"][1], True, 2)]
    kinds = [("last", pos["last"][1], True, 1)]
    heavy = stage_layers(m, lay)
    if pos["first"][1] == heavy > pos["last"][1]:
        kinds.append(("first", heavy, False, 1))
    elif "middle" in pos:
        kinds.append(("middle", heavy, False, 0))
    return kinds
