"""A Hugging Face ``config.json`` (or a model directory holding one) as a planner ModelSpec.

The architecture is translated by the same code ``chipset train`` uses for ``model.init_from``
and ``model.hf_config`` (:func:`chipset.models.hf.config.from_hf_config`), so the planner
refuses exactly what training would refuse (exit 2, naming key, value and what is supported)
and plans the model training would build. What the cost model does not represent (q/k/v
biases, per-head q/k norms, a head width other than hidden / heads, experts narrower than
the dense MLP in a partly-MoE model) is returned as notes, so the CLI can say which estimates are approximate instead of silently planning another model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from chipset.errors import ConfigError
from chipset.models.config import ModelConfig
from chipset.models.hf.config import from_hf_config
from chipset.planner.model import ModelSpec, from_engine_model_config

__all__ = ["engine_spec", "is_hf_config", "load_hf_config", "read_hf_model"]

log = logging.getLogger(__name__)


def is_hf_config(path: str | Path) -> bool:
    """``--model`` names a config.json (any ``.json`` file) or a directory that holds one."""
    p = Path(path)
    return p.suffix == ".json" or (p.is_dir() and (p / "config.json").is_file())


def read_hf_model(path: str | Path, origin: str | None = None) -> ModelConfig:
    """The engine's model config translated from an HF config.json (or a directory holding one);
    ConfigError naming ``origin`` (default ``--model PATH``) when it cannot be read or translated."""
    p = Path(path)
    origin = origin or f"--model {str(path)!r}"
    file = p / "config.json" if p.is_dir() else p
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{origin}: cannot read {file} as JSON ({exc}); expected a Hugging Face "
                          "config.json or a model directory holding one") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{origin}: {file} is not a JSON object; expected a Hugging Face config.json")
    fields, problems = from_hf_config(hf)
    if problems:
        raise ConfigError(f"{origin} ({file}): the architecture is not one chipset trains:\n"
                          + "\n".join(f"  - {x}" for x in problems))
    return ModelConfig(**fields)


def engine_spec(m: ModelConfig, seq_len: int, name: str, origin: str | Path) -> tuple[ModelSpec, list[str]]:
    """``(spec, notes)`` for the decoder ``chipset train`` builds from ``m``; notes (also logged as
    warnings naming ``origin``) name what the estimate leaves out."""
    notes = []
    moe = m.num_experts > 1
    if moe and m.moe_intermediate_size and m.moe_intermediate_size != m.intermediate_size:
        if m.moe_every != 1:  # partly MoE (all-MoE: from_engine_model_config plans the experts' width)
            notes.append(f"experts {m.moe_intermediate_size} wide and dense blocks {m.intermediate_size} wide are "
                         f"planned at one width ({m.intermediate_size})")
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    if hd * m.num_attention_heads != m.hidden_size:
        notes.append(f"head_dim {hd} x {m.num_attention_heads} heads != hidden_size {m.hidden_size}: attention is "
                     "planned with head_dim = hidden_size / heads")
    if m.attention_bias:
        notes.append("q/k/v biases are not counted")
    if m.qk_norm:
        notes.append("per-head q/k norms are not counted")
    for note in notes:
        log.warning("%s: %s (the estimate is approximate there)", origin, note)
    return from_engine_model_config(m, seq_len=seq_len, name=name), notes


def load_hf_config(path: str | Path) -> tuple[ModelSpec, list[str]]:
    """``(spec, notes)``: the model of an HF config.json; notes (also logged as warnings) name what
    the estimate leaves out."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    m = read_hf_model(path)
    name = file.parent.name if file.name == "config.json" else file.stem
    return engine_spec(m, m.max_position_embeddings, name or "hf", path)
