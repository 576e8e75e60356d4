"""chipset parameter names <-> Hugging Face tensor names.

chipset's names are Llama's without the ``model.`` prefix, with the final norm and the
logit layer under ``head.``; the rotary convention is the same (rotate-half), so q and k
rows map one to one, with no permutation. Mixture-of-experts layers differ: chipset
stacks the experts of a layer into one ``[E, out, in]`` tensor per projection, HF files
keep one tensor per expert, under family-specific names (:data:`MOE_NAMES`).
"""

from __future__ import annotations

__all__ = ["MOE_NAMES", "to_hf", "expert_names", "from_hf"]

MOE_NAMES = {
    # family: (HF name of the MoE block, of its router, {chipset stacked tensor: HF per-expert name})
    "mixtral": ("block_sparse_moe", "gate", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen3_moe": ("mlp", "gate", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    # Qwen2-MoE's shared expert keeps its HF names in chipset (mlp.shared_expert.*, mlp.shared_expert_gate).
    "qwen2_moe": ("mlp", "gate", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
}


def to_hf(name: str, family: str = "llama") -> str:
    """``layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight`` (not stacked experts)."""
    if name == "head.lm_head.weight":
        return "lm_head.weight"
    if name.startswith("head."):
        return "model." + name.removeprefix("head.")
    if family in MOE_NAMES and ".mlp.router." in name:
        block, router, _ = MOE_NAMES[family]
        return "model." + name.replace(".mlp.router.", f".{block}.{router}.")
    return "model." + name


def expert_names(name: str, family: str, num_experts: int) -> list[str] | None:
    """The HF names of the experts stacked in chipset's ``name`` (``layers.i.mlp.experts.up_proj``), else None."""
    if family not in MOE_NAMES or ".mlp.experts." not in name:
        return None
    block, _, per_expert = MOE_NAMES[family]
    prefix, _, proj = name.rpartition(".")
    prefix = "model." + prefix.replace(".mlp.experts", f".{block}.experts")
    return [f"{prefix}.{e}.{per_expert[proj]}.weight" for e in range(num_experts)]


def from_hf(name: str) -> str:
    """The inverse of :func:`to_hf` for dense families."""
    if name == "lm_head.weight":
        return "head.lm_head.weight"
    if name == "model.norm.weight":
        return "head.norm.weight"
    return name.removeprefix("model.")
