"""Compute time of one micro-batch on one stage, kernel by kernel (see docs/planner.md, "Time").

Every matrix multiply is costed by a roofline of its own shape (M tokens, N outputs, K
inputs): time = max(2MNK / (peak · eff), 2(MK + KN + MN) bytes / bandwidth), with
eff = e_max · d / (d + d_half), d = min(M, N, K). The curve is the tile-quantisation
shape of public GEMM benchmarks (NVIDIA's "Matrix Multiplication Background" guide:
throughput rises with each dimension until the tiles and waves fill the device; cuBLAS
bf16 on A100/H100 reaches 80-90%/70-80% of the dense datasheet peak for large squares, and
falls off once a dimension drops to a few hundred). Backward runs the data-gradient and
weight-gradient GEMMs, whose dimensions are the forward's permuted, so they cost twice the
forward at the same efficiency.

Attention's core (QK^T and AV, 4·s·h FLOPs per token forward) is either a fused
flash-attention kernel at the profile's attention efficiency (backward executes 2.5× the
forward FLOPs, Dao 2023, Sec. 3.2), or batched GEMMs of width head_dim plus a materialised
s×s score matrix whose softmax/dropout traffic is memory-bound.

Memory-bound kernels (norms, residual adds, dropout, rotary, activation) move their
actual bytes at the achievable fraction of memory bandwidth: forward reads inputs and
writes outputs; backward reads the gradient and the saved input and writes the input
gradient (twice the forward bytes). The loss on the last stage moves ``TrainSpec.loss_bytes``
per logit: a fused cross-entropy three passes over the logits, an eager one in fp32 many
more (:func:`loss_bytes_per_logit`).

Full recompute reruns each block's forward inside backward. With
``TrainSpec.recompute_early_stop`` (torch.utils.checkpoint without reentrancy, torch 2.1
and later, which chipset's engine uses) it stops once every tensor that backward saved
has been recomputed: a dense block whose MLP output projection feeds only the residual add
does not rerun that projection (:func:`not_recomputed_shapes`).

FP8 (``TrainSpec.fp8`` not "off", as ``train.fp8`` runs it: parallel/fp8.py): the attention and
dense-MLP projections (:func:`projection_shapes`), forward and both backward GEMMs, are costed at
the device's FP8 peak (``float8_e4m3fn``, or ``float8_e4m3fnuz`` where that is what it declares);
the vocabulary head, MoE experts and router and the attention core keep ``train.dtype``'s peak.
Their byte roofline keeps ``train.dtype``'s bytes: the engine quantises the operands on the fly
from tensors held in that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from chipset.planner.assumptions import Assumptions
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.model import ModelSpec

__all__ = ["FP8_PEAK_KEYS", "StageCompute", "device_stage_compute", "device_fp8_peak", "gemm_curve", "gemm_time",
           "loss_bytes_per_logit", "matmul_shapes", "not_recomputed_shapes", "projection_shapes",
           "recompute_stops_early", "stage_compute"]

FP8_PEAK_KEYS = ("float8_e4m3fn", "float8_e4m3fnuz")
"""The peak FLOP/s entries an FP8 GEMM runs at (forward operands in e4m3), the first a profile declares."""


@dataclass(frozen=True)
class StageCompute:
    """Seconds one micro-batch of one stage spends, by kernel class (recompute included)."""

    gemm_s: float
    """Projection, MLP and logit GEMMs."""
    attention_s: float
    """Attention core: flash kernel, or score GEMMs plus softmax traffic."""
    memory_s: float
    """Norms, residuals, dropout, rotary and activation kernels."""
    gemm_flops: float
    """FLOPs of the GEMMs above (for the effective efficiency)."""
    gemm_peak_s: float = 0.0
    """With FP8: seconds the GEMMs above take at 100% of their peaks (FP8 or train.dtype's), the
    denominator of their effective efficiency; 0 when one peak serves them all."""

    def gemm_efficiency(self, peak: float) -> float:
        """The fraction of peak the GEMMs reach together (each at its own peak when FP8 mixes two)."""
        if self.gemm_s <= 0:
            return 0.0
        return self.gemm_peak_s / self.gemm_s if self.gemm_peak_s else self.gemm_flops / (peak * self.gemm_s)

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s


def _eff(d: float, e_max: float, half: float) -> float:
    return e_max * d / (d + half)


def gemm_curve(dev, a: Assumptions) -> tuple[float, float]:
    """(efficiency of large GEMMs, half-dimension) of the curve for device properties ``dev``:
    the values it declares (``matmul_efficiency``, ``matmul_half_dim``), else ``a``'s."""
    if dev is None:
        return a.gemm_efficiency, a.gemm_half_dim
    return dev.matmul_efficiency or a.gemm_efficiency, dev.matmul_half_dim or a.gemm_half_dim


def gemm_time(M: float, N: float, K: float, peak: float, bandwidth: float, e_max: float, half: float,
              elem_bytes: float = 2.0) -> float:
    """Seconds of one (M x K)·(K x N) multiply: the slower of its FLOP and byte rooflines."""
    if min(M, N, K) <= 0:
        return 0.0
    t = 2 * M * N * K / (peak * _eff(min(M, N, K), e_max, half))
    if bandwidth > 0:
        t = max(t, elem_bytes * (M * K + K * N + M * N) / bandwidth)
    return t


def projection_shapes(m: ModelSpec, lay: Layout, tokens: float) -> list[tuple[float, float, float, float]]:
    """(M, N, K, count) of one block's attention and dense-MLP projections on one device: the GEMMs
    ``train.fp8`` runs in FP8 (parallel/fp8.py)."""
    h, t, f = m.hidden, lay.tp, m.ffn
    up = 2 * f if m.mlp == "swiglu" else f
    out = [(tokens, (h + 2 * m.kv_dim) / t, h, 1.0), (tokens, h, h / t, 1.0)]
    dense = m.dense_layers / m.layers
    if dense > 0:
        out += [(tokens, up / t, h, dense), (tokens, h, f / t, dense)]
    return out


def matmul_shapes(m: ModelSpec, lay: Layout, tokens: float) -> list[tuple[float, float, float, float]]:
    """(M, N, K, count) of one block's forward GEMMs on one device (dense and MoE blocks
    weighted by their share of layers): :func:`projection_shapes` first, then MoE's."""
    h, t, f = m.hidden, lay.tp, m.ffn
    up = 2 * f if m.mlp == "swiglu" else f
    out = projection_shapes(m, lay, tokens)
    dense = m.dense_layers / m.layers
    if m.is_moe:
        moe = 1 - dense
        per_expert = lay.ep * tokens * m.top_k / m.num_experts  # tokens each local expert sees
        experts = m.num_experts / lay.ep
        out += [(per_expert, up / t, h, moe * experts), (per_expert, h, f / t, moe * experts),
                (tokens, m.num_experts, h, moe)]
        if m.shared_ffn:  # every token through the shared expert, placed over tp like the experts
            st = t if m.experts_split_over_tp else 1
            sup = 2 * m.shared_ffn if m.mlp == "swiglu" else m.shared_ffn
            out += [(tokens, sup / st, h, moe), (tokens, h, m.shared_ffn / st, moe), (tokens, 1, h, moe)]
    return out


def recompute_stops_early(m: ModelSpec, lay: Layout, train: TrainSpec) -> bool:
    """Full recompute stops before a dense block's MLP output projection (see
    :func:`not_recomputed_shapes`): torch's early stop, and no dropout after the projection."""
    return lay.recompute == "full" and train.recompute_early_stop and not m.dropout


def not_recomputed_shapes(m: ModelSpec, lay: Layout, tokens: float, train: TrainSpec
                          ) -> list[tuple[float, float, float, float]]:
    """(M, N, K, count) of the forward GEMMs a full recompute skips, per block on one device.

    torch's non-reentrant checkpoint stops recomputing once the last tensor backward saved
    is back (``TrainSpec.recompute_early_stop``). In a dense block that is the input of the
    MLP's output projection: the projection itself, and the residual add after it, save
    nothing. Dropout after the projection saves its mask and a MoE combine saves the expert
    outputs, so those blocks rerun everything."""
    if not recompute_stops_early(m, lay, train):
        return []
    dense = m.dense_layers / m.layers
    return [(tokens, m.hidden, m.ffn / lay.tp, dense)] if dense > 0 else []


def loss_bytes_per_logit(e: float) -> float:
    """Bytes an eager cross-entropy in fp32 moves per logit of dtype size ``e``, forward and
    backward (``F.cross_entropy(logits.float(), ...)``, or autocast's fp32 loss): forward
    casts (read e, write 4) and log-softmaxes (read 4, write 4); backward writes the
    loss gradient (4), runs log-softmax backward (read 8, write 4) and casts back (read 4,
    write e). 36 bytes for bf16 logits, 24 for fp32 ones (no casts)."""
    cast = 2 * (e + 4) if e != 4 else 0.0
    return cast + 8 + 4 + 12


def _memory_bytes_per_token(m: ModelSpec, lay: Layout, e: float) -> float:
    """Forward bytes of one block's memory-bound kernels per token on one device."""
    h, t = m.hidden, lay.tp
    rep = t if lay.sp else 1  # outside the tp region each rank sees all tokens unless sequence-parallel
    b = 2 * (2 * e * h) / rep  # two norms: read, write
    b += 2 * (3 * e * h) / rep  # two residual adds: read two, write one
    if m.dropout:
        b += 2 * (2 * e * h + h) / rep  # read, write, 1-byte mask
    if m.position == "rope":
        b += 2 * e * (h + m.kv_dim) / t  # rotate q and k in place
    f_local = m.ffn / t * (m.top_k if m.is_moe else 1)
    if m.is_moe and m.shared_ffn:
        f_local += m.shared_ffn / (t if m.experts_split_over_tp else 1) * m.moe_layers / m.layers
    b += (3 if m.mlp == "swiglu" else 2) * e * f_local  # activation (gate·up -> out, or read/write)
    return b


def stage_compute(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec, blocks: float,
                  peak: float, bandwidth: float, a: Assumptions, e_max: float, attn_eff: float,
                  with_logits: bool = True, half_dim: float = 0.0, fp8_peak: float = 0.0) -> StageCompute:
    """Compute seconds of one micro-batch of a stage of ``blocks`` blocks (see module doc);
    ``half_dim``: the device's declared GEMM curve (0: ``Assumptions.gemm_half_dim``);
    ``fp8_peak`` > 0: the FP8 peak the projections run at (``TrainSpec.fp8``)."""
    e = train.param_bytes
    s_local = seq_len / lay.cp
    tokens = lay.micro_batch * s_local
    half = half_dim or a.gemm_half_dim
    mem_bw = bandwidth * a.memory_efficiency if bandwidth > 0 else 0.0
    # passes of the block's forward executed: forward, backward (2x), recompute
    full = 1.0 if lay.recompute == "full" else 0.0
    fwd_passes = 3 + full
    gemm = gemm_flops = ideal = 0.0
    fp8 = len(projection_shapes(m, lay, tokens)) if fp8_peak > 0 else 0  # the first shapes: projections
    for i, (M, N, K, count) in enumerate(matmul_shapes(m, lay, tokens)):
        at = fp8_peak if i < fp8 else peak
        gemm += count * fwd_passes * gemm_time(M, N, K, at, bandwidth, e_max, half, e)
        gemm_flops += count * fwd_passes * 2 * M * N * K
        ideal += count * fwd_passes * 2 * M * N * K / at
    for M, N, K, count in not_recomputed_shapes(m, lay, tokens, train):  # a dense MLP projection
        at = fp8_peak if fp8 else peak
        gemm -= count * gemm_time(M, N, K, at, bandwidth, e_max, half, e)
        gemm_flops -= count * 2 * M * N * K
        ideal -= count * 2 * M * N * K / at
    gemm *= blocks
    gemm_flops *= blocks
    ideal *= blocks
    if with_logits:
        V = m.vocab / lay.tp
        gemm += 3 * gemm_time(tokens, V, m.hidden, peak, bandwidth, e_max, half, e)
        gemm_flops += 3 * 2 * tokens * V * m.hidden
        ideal += 3 * 2 * tokens * V * m.hidden / peak

    heads = m.heads / lay.tp
    core_fwd = 4 * tokens * seq_len * m.hidden / lay.tp  # QK^T and AV, full s x s as flops.py counts
    recompute_core = 1.0 if lay.recompute in ("full", "selective") else 0.0
    if m.flash_attention:
        attention = core_fwd * (1 + 2.5 + recompute_core) / (peak * attn_eff)
    else:
        per_head = lay.micro_batch * heads
        one = 2 * gemm_time(s_local, seq_len, m.head_dim, peak, bandwidth, e_max, half, e) * per_head
        attention = one * (3 + recompute_core)
        if mem_bw > 0:
            scores = lay.micro_batch * heads * s_local * seq_len
            # scores written, softmax read+write, (dropout read+write+mask), AV reads probs
            fwd_bytes = scores * (e + 2 * e + (2 * e + 1 if m.dropout else 0) + e)
            attention += fwd_bytes * (1 + 2 + recompute_core) / mem_bw
    attention *= blocks

    memory = 0.0
    if mem_bw > 0:
        memory = _memory_bytes_per_token(m, lay, e) * tokens * blocks * (1 + 2 + full) / mem_bw
        if with_logits:
            per_logit = train.loss_bytes or (3 * e if m.kernels == "fused" else loss_bytes_per_logit(e))
            memory += per_logit * tokens * m.vocab / lay.tp / mem_bw
    return StageCompute(gemm, attention, memory, gemm_flops, ideal if fp8 else 0.0)


def device_fp8_peak(dev) -> float:
    """The FP8 GEMM peak of device properties ``dev`` (:data:`FP8_PEAK_KEYS`); 0.0 when it declares none."""
    return next((p for key in FP8_PEAK_KEYS if (p := dev.peak_flops_for(key)) > 0), 0.0)


def device_stage_compute(m: ModelSpec, lay: Layout, seq_len: int, train: TrainSpec, blocks: float, dev,
                         a: Assumptions, with_logits: bool = True) -> StageCompute:
    """:func:`stage_compute` on device properties ``dev``: its peak for ``train.dtype`` (and its FP8
    peak for the projections when ``train.fp8`` is on), its bandwidth, and its declared GEMM curve
    and attention efficiency, else ``a``'s."""
    e_max, half = gemm_curve(dev, a)
    return stage_compute(m, lay, seq_len, train, blocks, dev.peak_flops_for(train.dtype), dev.memory_bandwidth, a,
                         e_max, dev.attention_efficiency or a.attention_efficiency, with_logits=with_logits,
                         half_dim=half, fp8_peak=device_fp8_peak(dev) if train.fp8 != "off" else 0.0)
