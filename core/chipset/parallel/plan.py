"""The vocabulary a model family declares its parallel plan in: layout names and tensor-parallel styles.

Declared once here; the families (chipset.models) write plans in it, the transforms of this room
apply them, and configuration checks and docs quote it.
"""

from __future__ import annotations

import fnmatch

from torch import nn

__all__ = ["LAYOUTS", "PLAN_STYLES", "plan_matches"]

LAYOUTS = ("dp", "zero1", "zero2", "zero3", "tp", "sp", "pp", "ep", "cp")
"""Names a family lists in :attr:`ModelFamily.layouts`: data parallelism (ZeRO 0 is plain
dp), ZeRO stages 1-3, tensor, sequence, pipeline, expert and context parallelism."""

PLAN_STYLES = {
    "colwise": "nn.Linear: output features (and bias) split over tp; the input enters the tp region",
    "colwise_in_region": "nn.Linear: as colwise, reading the output of a region_norm (the region is "
                         "entered once there for every projection that reads it)",
    "rowwise": "nn.Linear: input features split; partial outputs summed over tp, then the bias added once",
    "vocab_embedding": "nn.Embedding: vocabulary rows split (padded to a multiple of tp); partial "
                       "embeddings summed",
    "vocab_head": "nn.Linear: logits split over the (padded) vocabulary (the input enters the tp region, "
                  "as colwise); the loss becomes the vocabulary-parallel cross-entropy (held by the split head)",
    "vocab_head_in_region": "nn.Linear: as vocab_head, reading the output of a region_norm",
    "region_norm": "RMSNorm (weight, eps, kernels): its output enters the tp region once for the "
                   "colwise_in_region / vocab_head_in_region layers reading it",
    "head_norm": "RMSNorm over each head of a head-split tensor: its weight's gradient is summed over tp",
    "sequence_norm": "RMSNorm that, with sequence parallelism, runs on this rank's sequence slice in front "
                     "of a sequence_gathered module (weight gradient summed over tp); unchanged without",
    "sequence_gathered": "a replicated module that needs whole sequences: with sequence parallelism its "
                         "input is gathered over tp and its output sliced back; unchanged without",
    "replicated": "left whole on every rank (the default for anything the plan does not name)",
}
"""The tensor-parallel plan's vocabulary, style -> what the engine does with the module
(parallel/tensor.py applies it; docs/models.md, "Writing a tensor-parallel plan")."""


def plan_matches(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style for every module the plan names (first matching pattern wins)."""
    out = {}
    for name, _ in model.named_modules():
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                out[name] = style
                break
    return out
