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

    gemm_efficiency: float = 0.70
    """Fraction of dense peak FLOP/s that large matrix multiplications sustain end to end
    (kernel efficiency times launch gaps): large bf16 GEMMs reach 70-85% of peak on
    current GPUs; we take the low end because the model has no other per-kernel overhead."""
    gemm_half_dim: int = 128
    """Per-device GEMM width at which efficiency halves: the efficiency is
    gemm_efficiency * d / (d + gemm_half_dim), d = min(hidden/tp, tokens per micro-batch).
    Models the loss of tile utilisation when tp slices matrices thin."""
    elementwise_traffic: float = 3.0
    """Memory-bound work (norms, activations, softmax, dropout, residuals) moves this many
    times the bytes of the stored activations per block (written in forward, read and
    gradient written in backward); its time is bytes / memory bandwidth."""
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
    cp_overlap: bool = True
    """Ring attention overlaps its K/V exchange with attention compute."""
    max_micro_batch: int = 16
    """Largest micro-batch the search tries (all divisors of the per-replica batch up to it)."""
