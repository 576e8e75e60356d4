"""The layout check: the run's parallel layout against what ``chipset plan`` recommends for the same
model on the same cluster (the run's ``config.toml``, world size and device profile).

A ``layout`` finding comes when the planner's fastest layout has other degrees (dp, tp, pp, ep, cp)
than the run's and either the run is communication-bound while that layout is predicted to
communicate less (warning), or that layout is predicted at least ``FASTER`` times faster (info).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chipset.errors import ChipsetError

FASTER = 1.25
COMM_TERMS = ("tp", "ep", "cp_exposed", "pp", "dp_exposed", "step_comm")
"""The planner's breakdown terms that are communication (seconds per step)."""
DEGREES = ("dp", "tp", "pp", "ep", "cp")


def _label(lay) -> str:
    return " ".join(f"{k}={getattr(lay, k)}" for k in DEGREES) + f" zero={lay.zero}"


def _cluster_spec(summary: dict[str, Any]) -> str | None:
    dev = summary.get("devices") or {}
    world, per, name = summary.get("world_size"), dev.get("count_per_node"), dev.get("name")
    if not (isinstance(world, int) and world > 0 and isinstance(name, str) and name):
        return None
    if isinstance(per, int) and per > 0 and world > per and world % per == 0:
        return f"{world // per}x{per}:{name}"
    return f"1x{world}:{name}"


def layout_check(run_dir: Path, summary: dict[str, Any],
                 comm_bound: bool) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(finding dicts, what the run directory lacked, checks that do not apply) for ``run_dir``."""
    config = run_dir / "config.toml"
    spec = _cluster_spec(summary)
    if not config.is_file():
        return [], ["config.toml not found: no layout check against 'chipset plan'"], []
    if spec is None:
        return [], ["summary.json has no world_size or devices.name: no layout check against 'chipset plan'"], []
    from chipset.planner import evaluate, resolve_cluster, search
    from chipset.planner.cluster import list_profiles
    from chipset.planner.run import from_run_config
    from chipset.train.config import load_config

    profile = spec.partition(":")[2]
    if profile not in list_profiles():
        return [], [], [f"no planner profile named {profile!r} (the run's device): no layout check"]
    try:
        cfg = load_config(config)
        model, mine, train = from_run_config(cfg, summary["world_size"])
        cluster = resolve_cluster(spec)
        best = search(model, train, cluster).candidates[0]
        ran = evaluate(model, mine, train, cluster)
    except (ChipsetError, ValueError, KeyError, AttributeError) as exc:  # another family, an old config
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [], [], [f"the planner cannot plan this run's model ({why[:160]}): no layout check"]
    if all(getattr(best.layout, k) == getattr(mine, k) for k in DEGREES):
        return [], [], []
    comm = {"run": sum(ran.breakdown.get(k, 0.0) for k in COMM_TERMS),
            "best": sum(best.breakdown.get(k, 0.0) for k in COMM_TERMS)}
    speedup = ran.step_time_s / best.step_time_s if best.step_time_s > 0 else 1.0
    if comm_bound and comm["best"] < comm["run"]:
        severity, why = "warning", "the run is communication-bound and that layout moves less over the links"
    elif speedup >= FASTER:
        severity, why = "info", f"predicted {speedup:.2f}x faster"
    else:
        return [], [], []
    have, want = _label(mine), _label(best.layout)
    return [dict(
        kind="layout", severity=severity, rank=None, step=None,
        title=f"layout {have}: 'chipset plan' recommends {want} for this model on {spec} ({why})",
        evidence={"layout": have, "recommended": want, "cluster": spec,
                  "predicted_step_s": ran.step_time_s, "recommended_step_s": best.step_time_s,
                  "predicted_comm_s": comm["run"], "recommended_comm_s": comm["best"],
                  "communication_bound": comm_bound},
        confidence=0.8 if severity == "warning" else 0.5,
        advice="rerun with the recommended layout ("
               + " ".join(f"--set parallel.{k}={getattr(best.layout, k)}" for k in (*DEGREES, "zero"))
               + f"); the whole ranking: chipset plan {config} --cluster {spec}")], [], []
