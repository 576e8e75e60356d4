"""A model for the planner from a TOML file: a ``[model]`` table of planner keys, a preset, or a
``chipset train`` config (a Hugging Face model's architecture comes from its config.json)."""

from __future__ import annotations

import sys
from pathlib import Path

from chipset.errors import ConfigError
from chipset.planner.hf import load_hf_config
from chipset.planner.model import ModelSpec, _update, get_preset
from chipset.preflight import read_text_file

__all__ = ["load_model_toml"]


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
    spec = base or ModelSpec(name=p.stem)
    if "preset" in table:
        spec = get_preset(str(table.pop("preset")))
    hf = [table.pop(k) for k in ("init_from", "hf_config") if k in table]
    if hf:  # a chipset train config of a Hugging Face model: its architecture comes from config.json
        spec = load_hf_config(Path(str(hf[0])).expanduser())[0]
    train = data.get("train")
    if isinstance(train, dict) and "seq_len" in train and "seq_len" not in table:
        table["seq_len"] = train["seq_len"]  # a chipset train config: plan at its sequence length
        table.pop("max_position_embeddings", None)
    return _update(spec, table, str(p))
