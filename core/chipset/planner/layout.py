"""A parallel layout and the training settings the cost model evaluates it under.

Rank order (the same as the engine's ParallelDims): a row-major grid over
``(pp, dp, cp, tp)`` with tp fastest-varying::

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

so tp groups are neighbouring ranks, cp groups have stride tp, dp groups stride tp*cp and
pp groups stride tp*cp*dp (outermost). Expert parallelism folds into dp*cp (world size
is dp*tp*pp*cp; ep divides dp*cp): an ep group is ep consecutive indices of the combined
(dp, cp) coordinate, so it has stride tp and sits between cp and dp in locality.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from chipset.errors import ConfigError
from chipset.parallel.context import CP_ATTENTION
from chipset.parallel.defaults import DEFAULT_CP_ATTENTION, DEFAULT_SEQUENCE_PARALLEL
from chipset.parallel.recompute import RECOMPUTE
from chipset.parallel.schedule import SCHEDULES as PIPELINE_SCHEDULES

__all__ = ["Layout", "TrainSpec", "SCHEDULES", "RECOMPUTE"]

SCHEDULES = PIPELINE_SCHEDULES  # chipset train's parallel.schedule names, declared by the runtime
# parallel.cp_attention's names: the engine's (CP_ATTENTION, parallel/context.py)


@dataclass(frozen=True)
class Layout:
    """One candidate: parallel degrees, ZeRO stage, micro-batch, schedule and recompute policy."""

    dp: int = 1
    """Data-parallel degree (replicas of the model)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of every block)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    ep: int = 1
    """Expert-parallel degree; divides dp*cp and num_experts."""
    cp: int = 1
    """Context-parallel degree (the sequence split across ranks, ring attention)."""
    zero: int = 0
    """ZeRO stage 0..3 over the dp*cp ranks that hold the same parameters."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    schedule: str = "1f1b"
    """Pipeline schedule, by chipset train's names (``parallel.schedule``): "1f1b", "gpipe",
    "interleaved_1f1b" (with ``virtual_stages`` chunks; labelled ``interleaved-vN`` in plans),
    "zero_bubble" (ZB-H1) or "zbv" (two chunks per rank placed in a V)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (v); > 1 only for the interleaved schedule and ZBV (2)."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" (attention core) or "full" (whole block)."""
    sequence_parallel: bool = DEFAULT_SEQUENCE_PARALLEL
    """With tp > 1, norms and dropout run sequence-parallel (Korthikanti et al. 2022)."""
    cp_attention: str = DEFAULT_CP_ATTENTION
    """With cp > 1: "ring" (K/V blocks passed round the ring, Liu et al. 2023), "allgather" (K/V
    gathered whole: the default, as in ``parallel.cp_attention``) or "ulysses"
    (all-to-all to a head split and back, Jacobs et al. 2023) or "hybrid" (Ulysses inside groups
    of ``cp_ulysses`` adjacent cp ranks, the ring across them; Fang and Zhao 2024, USP)."""
    cp_ulysses: int = 0
    """With ``cp_attention = "hybrid"``: the Ulysses degree inside the cp group (``parallel.cp_ulysses``);
    the ring runs over ``cp / cp_ulysses`` ranks. 0 otherwise."""
    offload_activations: bool = False
    """Each block's saved activations wait in host memory (``train.offload_activations``): one
    block's on the device, the others' copied out and back (``offload`` time)."""
    loss_chunk: int = 0
    """Tokens per chunk of the head and loss (``train.loss_chunk``); 0 = all at once."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def v(self) -> int:
        if self.schedule == "zbv":
            return 2 if self.pp > 1 else 1
        return self.virtual_stages if self.schedule == "interleaved_1f1b" else 1

    @property
    def schedule_label(self) -> str:
        """``"interleaved-v4"`` style label used in output and accepted by ``--fix``."""
        return f"interleaved-v{self.v}" if self.schedule == "interleaved_1f1b" else self.schedule

    def check(self) -> Layout:
        """Raise ConfigError for values no model could run with; return self otherwise."""
        problems = []
        for f in ("dp", "tp", "pp", "ep", "cp", "micro_batch", "virtual_stages"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"parallel.{f} must be a positive integer (found {v!r})")
        if self.zero not in (0, 1, 2, 3):
            problems.append(f"parallel.zero must be 0, 1, 2 or 3 (found {self.zero!r})")
        if self.schedule not in SCHEDULES:
            problems.append(f"parallel.schedule must be one of {', '.join(SCHEDULES)} (found {self.schedule!r})")
        elif self.schedule == "zbv" and self.pp > 1 and self.virtual_stages != 2:
            problems.append(f"parallel.schedule = 'zbv' places 2 chunks per rank in a V: set parallel.virtual_stages = 2 "
                            f"(found {self.virtual_stages!r})")
        if self.cp_attention not in CP_ATTENTION:
            problems.append(f"parallel.cp_attention must be one of {', '.join(CP_ATTENTION)} (found {self.cp_attention!r})")
        if self.cp_attention == "hybrid" and self.cp > 1 and not (
                1 < self.cp_ulysses < self.cp and self.cp % self.cp_ulysses == 0):
            problems.append(f"parallel.cp_ulysses must divide cp ({self.cp}) and lie between 2 and cp/2 with "
                            f"cp_attention hybrid (found {self.cp_ulysses!r})")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            problems.append(f"train.loss_chunk must be an integer >= 0 (found {self.loss_chunk!r})")
        if self.recompute not in RECOMPUTE:
            problems.append(f"parallel.recompute must be one of {', '.join(RECOMPUTE)} (found {self.recompute!r})")
        if not problems and (self.dp * self.cp) % self.ep:
            problems.append(f"parallel.ep ({self.ep}) must divide dp*cp ({self.dp * self.cp})")
        if problems:
            raise ConfigError("invalid layout: " + "; ".join(problems))
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrainSpec:
    """What one training step is: batch, precision, optimizer."""

    global_batch: int = 512
    """Sequences per optimizer step, over all data-parallel ranks."""
    dtype: str = "bfloat16"
    """Compute dtype: selects the device's peak FLOP/s."""
    fp8: str = "off"
    """``train.fp8``: not "off", the attention and MLP projections run at the device's FP8 peak
    (planner/kernels.py); everything else at ``dtype``'s."""
    param_bytes: int = 2
    """Bytes per parameter and per activation element in the compute dtype."""
    grad_bytes: int = 2
    """Bytes per gradient element as communicated and stored (bf16 grads: 2)."""
    optimizer_bytes: int = 12
    """Optimizer bytes per parameter: fp32 master copy + Adam m and v = 12 (ZeRO's K)."""
    update_bytes: float = 0.0
    """Bytes the optimizer update and gradient clipping read and write per local parameter.
    0 means one fused pass that reads and writes parameter, gradient and optimizer state once:
    2(P + G + K), as chipset's fused AdamW does. An update built from separate elementwise
    kernels moves more: torch.optim.AdamW with ``foreach=True`` makes eight passes over fp32
    state, 80 bytes per parameter, and norm clipping reads and rescales the gradient, 12 more."""
    loss_bytes: float = 0.0
    """Bytes the loss moves per logit, forward and backward. 0: as the model's kernels do
    (``ModelSpec.kernels``): a fused cross-entropy reads the logits forward, reads them and
    writes their gradient backward (3 x param_bytes); the reference kernels, an eager fp32
    cross-entropy (:func:`chipset.planner.kernels.loss_bytes_per_logit`, 36 for bf16 logits)."""
    recompute_early_stop: bool = True
    """Full recompute stops once backward's saved tensors are back, as torch.utils.checkpoint
    without reentrancy does from torch 2.1 (chipset's engine): a dense block does not rerun its
    MLP output projection. False: the whole forward reruns (Megatron-LM's and reentrant
    checkpointing, torch 2.0's non-reentrant one)."""
    fp8_gather_fraction: float = 0.0
    """The share of the dense parameters ZeRO-3 all-gathers in FP8, 1 byte each instead of
    ``param_bytes`` (``train.fp8 = "tensorwise"`` with ``train.fp8_all_gather``: the projection
    weights; runtime/data_parallel.py). 0: every parameter gathered in the compute dtype."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (ZeRO 0-2): reduce-scatters and optimizer temporaries work one
    bucket at a time (used by the reference-kernel memory model)."""
