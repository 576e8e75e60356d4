"""Rules on what the model did, beside time and memory: MoE routing skew and data-parallel replicas
that stopped being identical (metrics.jsonl ``moe`` and ``param_sum``, chipset.train.model_stats).
"""

from __future__ import annotations

import math
from collections import Counter

from chipset.diagnose.rules import steady
from chipset.errors import ConfigError
from chipset.parallel.dims import ParallelDims

MOE_SKEW = 1.5
"""A layer's step is skewed when its busiest expert gets at least this many times the mean choices
per expert (1 is perfect balance; under ``capacity_factor`` 1.25 that expert already drops
tokens, without a capacity its expert-parallel rank computes 1.5x as long as its peers) ..."""
NOISE_SIGMAS = 4.0
"""... and more than this many standard deviations above the mean of a uniform router
(binomial: choices x 1/E x (1 - 1/E)): few tokens are unevenly spread by chance alone."""
MOE_SHARE = 0.5
"""... in at least this share of the steady steps."""
MOE_DROPS = 0.1
"""A skewed layer dropping at least this share of its router's choices is an error (tokens lost)."""


def _skewed(d):
    n, ratio, experts = d.get("choices"), d.get("max_over_mean"), d.get("experts")
    if not (isinstance(n, int) and n > 0 and isinstance(experts, int) and experts > 1
            and isinstance(ratio, (int, float)) and math.isfinite(ratio)):
        return False
    mean = n / experts
    sigma = math.sqrt(n * (1 / experts) * (1 - 1 / experts))
    return ratio >= MOE_SKEW and ratio * mean - mean > NOISE_SIGMAS * sigma


def moe_skew(recs, summary):
    rows = steady([x for x in recs if isinstance(x.get("moe"), list)])
    if not rows:
        return [], []
    per: dict[int, list[tuple[int, dict]]] = {}
    for x in rows:
        for d in x["moe"]:
            if isinstance(d, dict) and isinstance(d.get("layer"), int):
                per.setdefault(d["layer"], []).append((x["step"], d))
    hot = []
    for layer, steps in per.items():
        sk = [(s, d) for s, d in steps if _skewed(d)]
        if sk and len(sk) >= MOE_SHARE * len(steps):
            hot.append((layer, steps, sk))
    if not hot:
        return [], []
    layer, steps, sk = max(hot, key=lambda h: sum(d["max_over_mean"] for _, d in h[2]) / len(h[2]))
    ratio = sum(d["max_over_mean"] for _, d in sk) / len(sk)
    drops = sum(float(d.get("dropped_share") or 0.0) for _, d in sk) / len(sk)
    tops = Counter(d["top_expert"] for _, d in sk)
    expert, times = tops.most_common(1)[0]
    share = len(sk) / len(steps)
    return [dict(
        kind="moe_routing_skew", severity="error" if drops >= MOE_DROPS else "warning", rank=None, step=sk[0][0],
        title=f"MoE layer {layer}: the busiest expert gets {ratio:.2f}x the mean load in {len(sk)} of "
              f"{len(steps)} steady steps (expert {expert} the busiest in {times} of them)"
              + (f", {drops:.0%} of choices dropped by capacity" if drops else "")
              + (f"; {len(hot) - 1} more layer(s) skewed" if len(hot) > 1 else ""),
        evidence={"layer": layer, "expert": expert, "expert_top_steps": times, "mean_max_over_mean": ratio,
                  "dropped_share": drops, "skewed_steps": [s for s, _ in sk], "first_step": sk[0][0],
                  "top_expert_per_step": [d["top_expert"] for _, d in sk], "num_experts": sk[0][1]["experts"],
                  "skewed_layers": sorted(h[0] for h in hot)},
        confidence=round(share, 3),
        advice="the router sends most tokens to few experts: raise model.router_aux_loss_coef (the load-"
               "balancing loss), check the data for repeated or degenerate batches (a token repeated "
               "over and over takes one route), and keep model.capacity_factor > 0 so an expert's "
               "overflow is dropped rather than slowing its expert-parallel rank")], []


def _replica_groups(summary, world):
    """Lists of ranks that hold the same parameters (differ only along dp), or None without a layout."""
    lay = summary.get("layout")
    if not isinstance(lay, dict):
        return None
    try:
        dims = ParallelDims(**{k: lay.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")},
                            zero=lay.get("zero", 0), world_size=world)
    except (ConfigError, TypeError):
        return None
    return [g for g in dims.dp_replicas() if len(g) > 1]


def replica_divergence(recs, summary):
    rows = [x for x in recs if isinstance(x.get("param_sum"), list) and x["param_sum"]]
    if not rows:
        return [], []
    world = len(rows[0]["param_sum"])
    groups = _replica_groups(summary, world)
    if groups is None:
        return [], ["summary.json has no readable layout: no replica-divergence check of param_sum"]
    for x in rows:
        for g in groups:
            values = [x["param_sum"][r] for r in g]
            if len(set(values)) == 1:
                continue
            common, n = Counter(values).most_common(1)[0]
            odd = [r for r in g if x["param_sum"][r] != common] if n > len(g) / 2 else list(g)
            agreed = [y["step"] for y in rows if y["step"] < x["step"]]
            later = sum(1 for y in rows if y["step"] >= x["step"] and len({y["param_sum"][r] for r in g}) > 1)
            who = (f"rank(s) {', '.join(map(str, odd))} differ from the other replicas" if len(odd) < len(g)
                   else f"ranks {', '.join(map(str, g))} disagree")
            return [dict(
                kind="replica_divergence", severity="error", step=x["step"],
                rank=odd[0] if len(odd) < len(g) else None,  # two replicas: which one is wrong is unknown
                title=f"data-parallel replicas diverged at step {x['step']}: {who} (parameter checksums differ)",
                evidence={"first_step": x["step"], "ranks": odd, "replica_group": g,
                          "param_sum": {str(r): x["param_sum"][r] for r in g},
                          "last_equal_step": agreed[-1] if agreed else None,
                          "diverged_checks": later, "checks": len(rows)},
                confidence=1.0,
                advice="replicas that should hold bit-identical parameters do not: silent data corruption on "
                       "a device or link of those ranks (check their hardware: ECC errors, a faulty card), a "
                       "collective that returned different results on different ranks, or code that updates "
                       "parameters per rank (rank-dependent randomness outside dropout); resume from a "
                       "checkpoint before that step and watch whether the same ranks diverge again")], []
    return [], []
