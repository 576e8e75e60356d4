"""Whether a run may continue from a checkpoint written under another config.

Parameter shapes alone do not make a resume correct: ``num_attention_heads`` can change
with the same shapes, and ``rope_theta``, the seeds or the data settings change what the
model computes or which tokens come next without changing any shape. So the config saved
in the checkpoint's ``state.json`` is compared with the new one key by key and only the
keys below may differ (docs/fault-tolerance.md, "What a resume may change").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chipset.errors import ConfigError
from chipset.train.config import canonical_key

__all__ = ["SAFE_KEYS", "SAFE_SECTIONS", "config_differences", "check_compatible"]

SAFE_SECTIONS = ("parallel",)
"""Layout and parallel sizes: a checkpoint reshards to any layout."""

SAFE_KEYS = frozenset({
    "train.steps",  # run longer or stop earlier
    "train.lr", "train.warmup_steps", "train.lr_schedule", "train.min_lr",  # the learning-rate schedule
    "train.decay_fraction",
    "train.eval_every", "train.eval_steps", "data.eval_path",  # evaluation reads, never trains
    "train.checkpoint_every", "train.keep_checkpoints", "train.async_checkpoint",  # checkpoint settings
    "train.log_every", "train.profile_steps", "train.metrics_sinks",  # logging and profiling
    "train.recompute",  # what is kept for backward, not what is computed
    "train.compile",  # how the same ops run (per-block compilation), not which
    "train.max_nonfinite_steps",  # when to give up on a diverged run
})


def _flat(cfg: dict[str, Any]) -> dict[str, Any]:
    """``section.key -> value``, old key names (config.KEY_ALIASES) under their current name, so a
    checkpoint saved before a rename is compared key by key like any other."""
    return {canonical_key(f"{sec}.{k}"): v for sec, keys in cfg.items() if isinstance(keys, dict)
            for k, v in keys.items()}


def safe(key: str) -> bool:
    return key in SAFE_KEYS or key.split(".", 1)[0] in SAFE_SECTIONS


def config_differences(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: saved -> new`` for every key that differs and may not.

    Keys on one side only (added to or dropped from chipset since the checkpoint was
    written) are not compared: their defaults apply.
    """
    a, b = _flat(saved), _flat(new)
    return [f"{key}: {a[key]!r} -> {b[key]!r}" for key in sorted(set(a) & set(b))
            if not safe(key) and a[key] != b[key]]


def check_compatible(path: Path, saved: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """Raise ConfigError (exit 2) listing every difference between ``saved`` and ``new`` that is not safe."""
    if not isinstance(saved, dict):
        return  # a checkpoint from before configs were saved: shapes are all there is to check
    diffs = config_differences(saved, new)
    if diffs:
        raise ConfigError(
            f"checkpoint {path} was written under a different config; resuming would silently change the run. "
            f"{len(diffs)} key(s) differ (saved -> new):\n" + "\n".join(f"  - {d}" for d in diffs)
            + "\nUse the saved values (the checkpoint's state.json holds its config), or --resume none with a "
            "new --run-dir to start a new run. Keys that may change on resume: "
            + ", ".join(sorted(SAFE_KEYS)) + ", and every parallel.* key.")
