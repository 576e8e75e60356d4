"""A model for the planner from a TOML file: a ``[model]`` table of planner keys, a preset, or a
``chipset train`` config, a run directory's config.toml included (a Hugging Face model's
architecture comes from its config.json unless the run already wrote it out)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from chipset.errors import ConfigError
from chipset.models.config import ModelConfig
from chipset.planner.hf import engine_spec, load_hf_config, read_hf_model
from chipset.planner.model import HF_ALIASES, HF_IGNORED, ModelSpec, _update, get_preset
from chipset.preflight import read_text_file

__all__ = ["load_model_toml"]

PLANNED_FAMILY = "transformer"
"""The one ``model.family`` the planner's decoder spec describes (HF-initialised and MoE models included)."""

_TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
_PLANNER_KEYS = frozenset(f.name for f in dataclasses.fields(ModelSpec)) | set(HF_ALIASES) | HF_IGNORED | {"head_dim"}


def load_model_toml(path: str | Path, base: ModelSpec | None = None) -> ModelSpec:
    """Read the ``[model]`` table of a TOML file (a ``preset = "name"`` key starts from a preset)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model file {str(p)!r} not found; pass an existing TOML file with a [model] table")
    try:
        data = tomllib.loads(read_text_file(p, "model file", "a TOML file with a [model] table"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"model file {str(p)!r} is not valid TOML: {exc}") from None
    table = data.get("model")
    if not isinstance(table, dict):
        raise ConfigError(f"model file {str(p)!r} has no [model] table; expected keys such as layers, hidden, heads")
    table = dict(table)
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    if _is_train_table(table):
        return _train_model(table, train, p)
    spec = base or ModelSpec(name=p.stem)
    if "preset" in table:
        spec = get_preset(str(table.pop("preset")))
    hf = [v for v in (table.pop(k, "") for k in ("init_from", "hf_config")) if v]
    if hf:  # a chipset train config of a Hugging Face model: its architecture comes from config.json
        spec = load_hf_config(Path(str(hf[0])).expanduser())[0]
    if "seq_len" in train and "seq_len" not in table:
        table["seq_len"] = train["seq_len"]  # a chipset train config: plan at its sequence length
        table.pop("max_position_embeddings", None)
    return _update(spec, table, str(p))


def _is_train_table(table: dict[str, Any]) -> bool:
    """A ``chipset train`` [model] table the planner's own keys cannot read: it names a family (as
    every run directory's config.toml does, with the family's own keys beside the shared ones) or
    keys only the engine's ModelConfig has."""
    keys = set(table) - {"init_from", "hf_config"}
    return "family" in table or (set(table) <= _TRAIN_KEYS and not keys <= _PLANNER_KEYS)


def _train_model(table: dict[str, Any], train: dict[str, Any], p: Path) -> ModelSpec:
    """The decoder ``chipset train`` would build from this [model] table, at the [train] seq_len.

    Read through the engine's own ModelConfig, so every key it writes is understood and an empty
    ``init_from = ""`` means none. When the table names a Hugging Face model but not its
    architecture (a config written by hand), config.json supplies it, as it does for training."""
    family = table.get("family", PLANNED_FAMILY)
    if family != PLANNED_FAMILY:
        raise ConfigError(
            f"{p}: model.family = {family!r}: the planner describes the built-in decoder only "
            f"(model.family = {PLANNED_FAMILY!r}: its own shapes, a Hugging Face model through model.init_from "
            "or model.hf_config, and mixture-of-experts models), not this family. For the data-parallel "
            "layouts of any nn.Module use: chipset plan --module package.module:factory --input-shape D1,D2,...")
    m = ModelConfig(**table)  # every key is a ModelConfig field (_is_train_table); values are checked as a spec
    ref = m.init_from or m.hf_config
    if ref and not m.architecture:
        m = read_hf_model(Path(ref).expanduser(), f"{p}: model.{'init_from' if m.init_from else 'hf_config'}")
    seq_len = train.get("seq_len", m.max_position_embeddings)
    name = Path(ref).name if ref else p.parent.name if p.name == "config.toml" else p.stem
    return engine_spec(m, seq_len, name or p.stem, p)[0]
