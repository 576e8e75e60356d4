"""Reward functions: ``f(prompts, completions, **metadata) -> list[float]``, weighted and checked.

``rl.rewards`` names them, comma-separated, each ``[WEIGHT*]module:function`` or the name of an
entry point of the group ``chipset.rewards`` (a package declares
``[project.entry-points."chipset.rewards"] my_reward = "pkg.mod:func"``). The metadata are the
prompt's fields (a task's ``answer``, a JSONL line's other keys), one list per field.

A reward that raises, returns something else than one finite number per completion, is a
:class:`RewardError` (a ConfigError: exit 2) naming the function, raised at the first step
before any update, so nothing of the run is lost.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from chipset.errors import ConfigError

__all__ = ["ENTRY_POINT_GROUP", "Reward", "RewardError", "resolve_rewards", "score"]

ENTRY_POINT_GROUP = "chipset.rewards"


class RewardError(ConfigError):
    """A reward function failed or returned a bad value."""


@dataclass
class Reward:
    name: str
    fn: Callable
    weight: float = 1.0


def _load(spec: str) -> Callable:
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"rl.rewards: cannot load {spec!r} ({exc}); expected module:function importable "
                              "here (put its folder on PYTHONPATH)") from None
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise ConfigError(f"rl.rewards: {spec!r} is neither module:function nor a {ENTRY_POINT_GROUP} entry "
                              f"point (installed: {', '.join(known) or 'none'})")
        try:
            fn = found[0].load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is the user's to fix; say which
            raise ConfigError(f"rl.rewards: entry point {spec!r} failed to load: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"rl.rewards: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def resolve_rewards(text: str, default: Callable | None = None, default_name: str = "task") -> list[Reward]:
    """The rewards ``rl.rewards`` names (``default``, the task's, when it is empty)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        if default is None:
            raise ConfigError("rl.rewards is empty and rl.task is empty: name at least one reward function "
                              "(module:function or a chipset.rewards entry point)")
        return [Reward(default_name, default)]
    out = []
    for item in items:
        weight, spec = 1.0, item
        head, star, tail = item.partition("*")
        if star:
            try:
                weight, spec = float(head), tail.strip()
            except ValueError:
                raise ConfigError(f"rl.rewards: {item!r}: expected WEIGHT*module:function with a number as "
                                  "WEIGHT, e.g. 0.5*my_rewards:length") from None
        if not math.isfinite(weight):
            raise ConfigError(f"rl.rewards: {item!r}: the weight must be finite")
        out.append(Reward(spec, _load(spec), weight))
    return out


def score(rewards: list[Reward], prompts: list[str], completions: list[str], meta: dict[str, list]
          ) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted total per completion and each reward's own values, checked."""
    each = {}
    for r in rewards:
        try:
            vals = r.fn(list(prompts), list(completions), **meta)
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with its name
            raise RewardError(f"reward {r.name} raised {type(exc).__name__}: {exc}; it is called as "
                              "f(prompts, completions, **metadata) -> list[float] (docs/rl.md)") from exc
        try:
            vals = [float(v) for v in vals]
        except (TypeError, ValueError):
            raise RewardError(f"reward {r.name} returned {type(vals).__name__} {str(vals)[:80]}; expected a list "
                              f"of {len(completions)} numbers, one per completion") from None
        if len(vals) != len(completions):
            raise RewardError(f"reward {r.name} returned {len(vals)} values for {len(completions)} completions; "
                              "expected one number per completion")
        bad = [i for i, v in enumerate(vals) if not math.isfinite(v)]
        if bad:
            raise RewardError(f"reward {r.name} returned a non-finite value ({vals[bad[0]]}) for completion "
                              f"{bad[0]} ({completions[bad[0]]!r}); rewards must be finite numbers")
        each[r.name] = vals
    total = [sum(r.weight * each[r.name][i] for r in rewards) for i in range(len(completions))]
    return total, each
