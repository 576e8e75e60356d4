"""The cost model's tunable assumptions, in one place, each with the reason for its default.

None of these defaults was fitted to the published runs in docs/planner.md; they are
round numbers from general experience of dense GEMM efficiency and allocator overheads.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Assumptions"]


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the efficiency and memory model."""

    gemm_efficiency: float = 0.75
    """Fraction of dense peak FLOP/s that large, well-shaped matrix multiplications sustain,
    used when the device profile declares no ``matmul_efficiency``: public cuBLAS bf16
    benchmarks reach 70-90% of the datasheet peak for large squares. Each GEMM then gets
    gemm_efficiency · d / (d + gemm_half_dim), d its smallest dimension (kernels.py)."""
    gemm_half_dim: int = 128
    """Smallest GEMM dimension at which efficiency halves: skinny GEMMs (thin tp slices,
    few tokens per expert, head_dim-wide attention products) leave tiles and waves part
    empty. 128 puts a 256-wide GEMM at 2/3 and a 4096-wide one at 97% of the large-GEMM
    rate. Measured on an H200 (chipset.planner.measured): on the 17 training-shape GEMMs
    64 and 128 predict alike (mean error 5.9% and 6.3%), a least-squares fit of the curve
    gives 104-128 (two runs), and with 128 the skinny 64/128/256 tokens x 4096 x 4096 GEMMs
    come out 28/18/7% fast where 64 gave 44/39/23%."""
    attention_efficiency: float = 0.45
    """Fraction of dense peak a fused flash-attention kernel sustains over forward and
    backward when the profile declares none (FlashAttention-2 reports 50-70% on A100 and
    about 35-40% on H100, Dao 2023; Shah et al. 2024)."""
    memory_efficiency: float = 0.85
    """Fraction of the datasheet memory bandwidth that streaming (elementwise, norm,
    optimizer) kernels achieve: STREAM-like copies reach 80-90% of HBM peak."""
    kernel_launch_latency: float = 8e-6
    """Seconds one kernel occupies the stream at least when an eager framework issues it:
    a CUDA-style launch costs about 3-5 us and PyTorch's eager dispatch a few more, so
    kernels shorter than this leave the device idle. Used when the device profile declares
    no ``kernel_launch_latency`` of its own."""
    kernels_per_block_forward: int = 12
    """Kernels one transformer block launches in forward with fused kernels: two norms, the
    QKV, output and two or three MLP projections, rotary, attention, the activation and two
    residual adds. Backward launches twice as many; full recompute repeats the forward."""
    kernels_per_step: int = 40
    """Kernels outside the blocks per step: embedding, final norm, logits, loss and their
    backward, gradient clipping and a multi-tensor (foreach) optimizer update."""
    step_host_overhead: float = 1e-3
    """Host seconds per optimizer step outside the kernels (data loading hand-off, zero_grad,
    learning-rate scheduler, loss synchronisation, logging). Used when the device profile
    declares no ``step_host_overhead`` of its own."""
    memory_usable_fraction: float = 0.90
    """Fraction of device memory a layout may plan to use; the rest goes to the runtime
    context, workspaces, communication buffers and allocator fragmentation."""
    dp_overlap: bool = True
    """Overlap data-parallel gradient reduction with the last micro-batch's backward and
    the parameter all-gather with the first micro-batch's forward (Megatron
    overlap-grad-reduce / overlap-param-gather, FSDP prefetch)."""
    overlap_contention: float = 0.3
    """Extra time, as a fraction of the overlapped span, when a collective runs beside compute:
    communication kernels occupy multiprocessors and memory bandwidth the GEMMs would use
    (measured overlap slowdowns of 10-40% are reported for NCCL beside GEMMs, e.g. Wang et
    al. 2023 "Overlap communication with dependent computation", Jangda et al. 2022)."""
    cp_overlap: bool = True
    """Ring attention overlaps its K/V exchange with attention compute (Ulysses' all-to-alls
    sit between the projections and attention: never overlapped)."""
    host_link_bandwidth: float = 25e9
    """Bytes/s between device and host memory for activation offload, one direction: a PCIe
    Gen4 x16 link moves about 25 GB/s in practice (Gen5: about 50). Offload copies are
    counted unoverlapped, an upper bound (on a backend with streams they run on a side stream
    beside compute, parallel/offload.py)."""
    max_micro_batch: int = 16
    """Largest micro-batch the search tries (all divisors of the per-replica batch up to it)."""
