"""chipset parameter names <-> Hugging Face tensor names (dense decoder families).

chipset's names are Llama's without the ``model.`` prefix, with the final norm and the
logit layer under ``head.``; the rotary convention is the same (rotate-half), so q and k
rows map one to one, with no permutation.
"""

from __future__ import annotations

__all__ = ["to_hf", "from_hf"]


def to_hf(name: str) -> str:
    """``layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    if name == "head.lm_head.weight":
        return "lm_head.weight"
    if name.startswith("head."):
        return "model." + name.removeprefix("head.")
    return "model." + name


def from_hf(name: str) -> str:
    """The inverse of :func:`to_hf`."""
    if name == "lm_head.weight":
        return "head.lm_head.weight"
    if name == "model.norm.weight":
        return "head.norm.weight"
    return name.removeprefix("model.")
