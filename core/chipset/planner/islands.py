"""Islands (DiLoCo / local SGD, docs/islands.md) in the planner: what an outer step sends between
islands, what it costs, and the ``sync_every`` (H) at which it stops mattering.

What one outer step moves is what ``train/islands/outer.py`` hands to the link
(``train/islands/link.py``): rank ``r`` of every island exchanges the float32 master slice it
owns (a bucket padded to a multiple of its ``n = dp*cp`` ranks, 1/n of it per rank) with rank
``r`` of the other islands, over a host gloo group of the ``count`` islands:

- fp32: one all-reduce of ``N`` float32 (``4N`` bytes handed over);
- bf16: one all-gather of ``N`` bf16 (``2N``);
- int8: an all-gather of ``N`` int8 codes and one of ``ceil(N / 2048)`` float32 scales;
- secure aggregation: one all-reduce of ``N`` int64 (``8N``, fixed point).

Those are the bytes the link's ``CommStats`` counts (``cross_island`` in an island's metrics).
Each rank *sends* the ring volume of them (``2(k-1)/k`` of an all-reduce's buffer, ``(k-1)``
times an all-gather's input), and every rank of an island sends at once, sharing the island's
link of ``link_bandwidth`` bytes/s: the busiest rank's bytes take ``ranks * sent / bandwidth``.

An outer step's time is the exchange on the link (``t_link``) and what the island does itself
(``t_fixed``): the pseudo-gradient's trips between device and host, the outer optimizer's
memory-bound pass over the owned slice, and the refresh of the island's parameters
(all-gathers inside the island at ZeRO 0-2); ``t_outer = t_link + t_fixed``.

``islands.overlap = "off"``: the outer step blocks the inner loop. A round of ``H`` inner steps
takes ``H t_inner + t_outer``, so per inner step ``T = t_inner + t_outer / H``.

``islands.overlap = "delayed"``: the exchange is started at the end of a round and waited for at
the end of the next, so the link works while the next ``H`` inner steps train; the island's own
part (``t_fixed``: the copies, the update and the refresh run on the training thread) stays
exposed. A round therefore takes ``t_fixed`` plus whichever is longer of the ``H`` inner steps and
the exchange, which ran beside them: ``max(H t_inner, t_link) + t_fixed``. Per inner step::

    T = max(t_inner, t_link / H) + t_fixed / H

The exposed share is ``f = (t_fixed + max(0, t_link - H t_inner)) / (max(H t_inner, t_link) +
t_fixed)``, non-increasing in ``H``; the break-even ``H`` is the smallest with ``f <= target``
(once ``H t_inner >= t_link`` only ``t_fixed`` is left: the blocking formula with ``t_fixed`` for
``t_outer``). The model assumes the link's transfer takes nothing from the inner steps (its
gloo threads and the network are apart from the devices) and leaves out the last step's
blocking outer step (one per run).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from chipset.errors import ConfigError
from chipset.planner.assumptions import Assumptions
from chipset.planner.comm import CommItem, latency_steps, ring_bytes
from chipset.planner.flops import forward_flops_per_token
from chipset.planner.memory import params_per_device
from chipset.planner.run import from_run_config
from chipset.planner.time import dp_exposed_time

__all__ = ["INT8_BLOCK", "DEFAULT_TARGET", "LinkSpec", "owned_elements", "exchange_calls", "outer_step_bytes", "break_even_sync_every",
           "outer_fraction", "sync_step_time", "islands_terms", "islands_for_config", "island_view", "default_link",
           "format_islands"]

INT8_BLOCK = 2048
"""Elements per float32 scale of an int8 pseudo-gradient (``train/islands/outer.py``'s block)."""

DEFAULT_TARGET = 0.05
"""The largest share of the time outer steps may take, for the break-even H, unless told otherwise."""

OUTER_ACCESSES = {"nesterov": 5, "sgd": 3}
"""Float32 reads and writes per owned element of the outer optimizer's update of the global
parameters (runtime/optim.py's SGD: read global, average, momentum; write momentum, global)."""


@dataclass(frozen=True)
class LinkSpec:
    """The link between islands and the share of the time the outer step may take."""

    bandwidth: float
    """Bytes/s each island's link to the others carries per direction (all its ranks share it)."""
    latency: float = 0.0
    """Seconds per message step on it."""
    target: float = DEFAULT_TARGET
    """Largest fraction of the time the outer step may take, for the break-even H."""

    def check(self) -> LinkSpec:
        if not self.bandwidth > 0 or math.isinf(self.bandwidth):
            raise ConfigError(f"inter-island bandwidth {self.bandwidth / 1e9:g} GB/s: expected a positive, finite "
                              "bandwidth of each island's link to the others (e.g. --inter-island-bw 1.25 for 10 Gb/s)")
        if not self.latency >= 0:
            raise ConfigError(f"inter-island latency {self.latency!r} s: expected seconds >= 0")
        if not 0 < self.target < 1:
            raise ConfigError(f"outer-step target {self.target!r}: expected the largest fraction of the time the "
                              "outer exchange may take, in (0, 1), e.g. 0.05 for 5%")
        return self


def owned_elements(m, lay) -> dict[str, int]:
    """Float32 elements one rank of each pipeline stage exchanges per outer step: its 1/n of every
    bucket padded to a multiple of n (``n = dp*cp``; experts over ``dp*cp/ep``), one bucket per
    parameter group (models under ``parallel.bucket_mb``)."""
    stages, expert = params_per_device(m, lay)
    n = lay.dp * lay.cp
    ne = max(1, n // lay.ep)
    return {s: math.ceil(round(psi) / n) + (math.ceil(round(expert) / ne) if expert else 0)
            for s, psi in stages.items()}


def exchange_calls(elements: int, dtype: str, secure: bool = False) -> list[tuple[str, int]]:
    """(op, bytes handed to the link) of each call one rank makes per outer step."""
    if secure:
        return [("all_reduce", 8 * elements)]
    if dtype == "fp32":
        return [("all_reduce", 4 * elements)]
    if dtype == "bf16":
        return [("all_gather", 2 * elements)]
    if dtype == "int8":
        return [("all_gather", elements), ("all_gather", 4 * math.ceil(elements / INT8_BLOCK))]
    raise ConfigError(f"islands.pseudo_grad_dtype = {dtype!r}: expected fp32, bf16 or int8")


def _sent(op: str, nbytes: float, k: int) -> float:
    """Bytes a rank sends for a call whose input is ``nbytes`` over ``k`` islands (ring)."""
    return (k - 1) * nbytes if op == "all_gather" else ring_bytes(op, nbytes, k)


def outer_step_bytes(elements: int, dtype: str, count: int, secure: bool = False) -> tuple[int, float]:
    """(bytes handed to the link, bytes sent) by one rank per outer step among ``count`` islands."""
    calls = exchange_calls(elements, dtype, secure)
    return sum(b for _, b in calls), sum(_sent(op, b, count) for op, b in calls)


def outer_fraction(t_outer: float, t_inner: float, h: int, t_hidden: float = 0.0) -> float:
    """Share of the time spent in outer steps: ``t_outer / (H t_inner + t_outer)``; with
    ``t_hidden`` (the delayed mode's exchange, part of ``t_outer``) running beside the ``H`` inner
    steps, only what it does not hide counts (module docstring)."""
    fixed = t_outer - t_hidden
    exposed = fixed + max(0.0, t_hidden - h * t_inner)
    return exposed / (max(h * t_inner, t_hidden) + fixed) if exposed > 0 else 0.0


def sync_step_time(t_outer: float, t_inner: float, h: int, t_hidden: float = 0.0) -> float:
    """Seconds per inner step: ``t_inner + t_outer / H``, or with ``t_hidden`` of ``t_outer``
    overlapped with the next H inner steps, ``max(t_inner, t_hidden / H) + (t_outer - t_hidden) / H``."""
    return max(t_inner, t_hidden / h) + (t_outer - t_hidden) / h


def break_even_sync_every(t_outer: float, t_inner: float, target: float, t_hidden: float = 0.0) -> int:
    """The smallest H >= 1 whose outer steps take at most ``target`` of the time (blocking:
    ``H >= t_outer (1 - target) / (target t_inner)``; ``t_hidden``: the delayed mode, module docstring)."""
    if t_outer <= 0:
        return 1
    if t_inner <= 0:
        raise ConfigError("the inner step takes no time: no H amortises the outer step")
    fixed = t_outer - t_hidden
    if fixed <= 0:  # everything hides once H t_inner covers the exchange
        h = max(1, math.ceil(t_hidden * (1 - target) / t_inner))
    else:
        h = max(1, math.ceil(fixed * (1 - target) / (target * t_inner)))
    while outer_fraction(t_outer, t_inner, h, t_hidden) > target:  # the exchange not yet hidden
        h *= 2
    lo = 1
    while lo < h:  # the fraction does not rise with H: the smallest H that meets the target
        mid = (lo + h) // 2
        lo, h = (mid + 1, h) if outer_fraction(t_outer, t_inner, mid, t_hidden) > target else (lo, mid)
    return h


def islands_terms(m, lay, train, dev, isl: Any, link: LinkSpec, t_inner: float, mb: int,
                  a: Assumptions | None = None) -> dict:
    """The outer step of an islands job whose islands each run ``lay`` with inner step ``t_inner``
    seconds on devices ``dev`` (``isl``: the ``[islands]`` table, read by attribute)."""
    a = a or Assumptions()
    link.check()
    k, h = int(isl.count), int(isl.sync_every)
    secure = bool(getattr(isl, "secure_aggregation", False))
    dtype = isl.pseudo_grad_dtype
    ranks = lay.world_size
    elements = owned_elements(m, lay)
    busiest = max(elements, key=elements.get)
    n_el = elements[busiest]
    handed, sent = outer_step_bytes(n_el, dtype, k, secure)
    calls = exchange_calls(n_el, dtype, secure)
    t_link = sum(latency_steps(op, k) for op, _ in calls) * link.latency + ranks * sent / link.bandwidth
    # device <-> host: the pseudo-gradient out, the average back (and the error-feedback residual)
    t_host = (3 if dtype != "fp32" else 2) * 4 * n_el / a.host_link_bandwidth
    accesses = 3 + (dtype != "fp32") + OUTER_ACCESSES.get(isl.outer_optimizer, 5) + (dtype != "fp32") + 2
    t_update = accesses * 4 * n_el / (dev.memory_bandwidth * a.memory_efficiency) if dev.memory_bandwidth > 0 else 0.0
    t_refresh = _refresh_time(lay, train, dev, n_el, isl.outer_optimizer)
    t_outer = t_link + t_host + t_update + t_refresh
    per_stage = lay.world_size // lay.pp
    island_handed = sum(per_stage * outer_step_bytes(e, dtype, k, secure)[0] for e in elements.values())
    dp = _plain_dp(m, lay, train, elements, per_stage, k, link, t_inner, mb, a)
    delayed = getattr(isl, "overlap", "off") == "delayed"
    hidden = t_link if delayed else 0.0
    t_isl = sync_step_time(t_outer, t_inner, h, hidden)
    t_dp = t_inner + dp["exposed"](link.bandwidth)
    match = _solve_bandwidth(dp["exposed"], t_isl - t_inner)
    return {
        "islands": k, "sync_every": h, "pseudo_grad_dtype": "int64 (secure)" if secure else dtype,
        "ranks_per_island": ranks, "inter_island_gbps": link.bandwidth / 1e9, "inter_island_latency_s": link.latency,
        "elements_per_rank": n_el, "bytes_per_rank": handed, "bytes_per_island": island_handed,
        "bytes_sent_per_rank": sent, "inner_step_s": t_inner, "inner_time_s": h * t_inner,
        "outer_time_s": t_outer, "outer_link_s": t_link, "outer_host_s": t_host, "outer_update_s": t_update,
        "outer_refresh_s": t_refresh,
        "overlap": "delayed (the exchange runs beside the next H inner steps)" if delayed
        else "none (the outer step blocks the inner steps)",
        "outer_hidden_s": min(hidden, h * t_inner), "outer_exposed_s": t_outer - min(hidden, h * t_inner),
        "step_time_s": t_isl, "outer_fraction": outer_fraction(t_outer, t_inner, h, hidden), "target": link.target,
        "break_even_sync_every": break_even_sync_every(t_outer, t_inner, link.target, hidden),
        "dp_step_time_s": t_dp, "dp_bytes_per_island_step": dp["bytes"], "speedup_over_dp": t_dp / t_isl,
        "dp_match_gbps": None if match is None else match / 1e9,
    }


def _refresh_time(lay, train, dev, n_el: int, outer_optimizer: str) -> float:
    """The island's parameters refreshed from the new masters (outer.py ``_refresh``): at ZeRO 0 the
    master, global parameters and momentum all-gathered over the n = dp*cp ranks, at ZeRO 1-2 the
    parameters; ZeRO 3 keeps its shard."""
    n = lay.dp * lay.cp
    if n <= 1 or lay.zero == 3:
        return 0.0
    gathers = [4] * (2 + (outer_optimizer == "nesterov")) if lay.zero == 0 else [train.param_bytes]
    bw = dev.intra_node_bandwidth
    return sum(latency_steps("all_gather", n) * dev.intra_node_latency
               + ((n - 1) * e * n_el / bw if bw > 0 else 0.0) for e in gathers)


def _plain_dp(m, lay, train, elements, per_stage, k, link, t_inner, mb, a) -> dict:
    """Data parallelism across the islands instead: every step each island all-reduces its whole
    gradient with the others (hierarchically: the least plain dp can send between islands), behind
    the backward as the planner's dp overlap rule allows. ``exposed(bandwidth)``: its seconds per step."""
    grad = sum(per_stage * e * train.grad_bytes for e in elements.values())
    sent = ring_bytes("all_reduce", grad, k)
    fw = forward_flops_per_token(m, m.seq_len)
    extra = {"none": 0, "selective": fw.attention_core, "full": fw.blocks}[lay.recompute]
    fwd = fw.total / (3 * fw.total + extra)
    work = t_inner / mb  # a micro-batch's compute at most: hides at most that much

    def exposed(bandwidth: float) -> float:
        t = latency_steps("all_reduce", k) * link.latency + sent / bandwidth
        item = CommItem(dim="dp", op="all_reduce", what="gradients", group_size=k, calls=1, bytes=sent,
                        intra_node=False, time_s=t, phase="grad")
        return dp_exposed_time([item], work * fwd, work * (1 - fwd), mb, a)

    return {"bytes": sent, "exposed": exposed}


def _solve_bandwidth(exposed, budget: float) -> float | None:
    """The bandwidth at which ``exposed(bandwidth)`` (falling) reaches ``budget``; None if it never does."""
    lo, hi = 1.0, 1e18
    if exposed(hi) > budget:
        return None
    if exposed(lo) <= budget:
        return lo
    for _ in range(200):  # bisection on log bandwidth
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if exposed(mid) <= budget else (mid, hi)
    return hi


def islands_for_config(cfg: Any, ranks_per_island: int, dev, link: LinkSpec, t_inner: float,
                       a: Assumptions | None = None) -> dict:
    """:func:`islands_terms` for an engine run config (``chipset train --project``): each island runs
    ``cfg``'s layout on ``ranks_per_island`` ranks and ``1/count`` of the global batch."""
    island_cfg = island_view(cfg)
    m, lay, train = from_run_config(island_cfg, ranks_per_island, kernels="fused")
    m = dataclasses.replace(m, vocab=math.ceil(m.vocab / lay.tp) * lay.tp)  # the engine pads it to tp
    return islands_terms(m, lay, train, dev, cfg.islands, link, t_inner, cfg.parallel.micro_batches, a)


def island_view(cfg: Any):
    """``cfg`` as one island runs it: ``train.global_batch / islands.count`` sequences per step."""
    import copy

    out = copy.deepcopy(cfg)
    out.train.global_batch = cfg.train.global_batch // max(1, cfg.islands.count)
    return out


def format_islands(d: dict, prefix: str = "chipset train") -> list[str]:
    """The lines ``chipset train --project`` and ``chipset plan`` print for an islands job."""
    match = ("dp cannot match it at any bandwidth" if d["dp_match_gbps"] is None
             else f"dp across the islands would need {d['dp_match_gbps']:.3g} GB/s to match")
    return [
        f"{prefix}: islands: {d['islands']} x {d['ranks_per_island']} rank(s), H = {d['sync_every']}, "
        f"{d['pseudo_grad_dtype']} pseudo-gradients: {_b(d['bytes_per_rank'])} per rank and "
        f"{_b(d['bytes_per_island'])} per island handed to the link each outer step",
        f"{prefix}: islands: inner {_s(d['inner_time_s'])} ({d['sync_every']} x {_s(d['inner_step_s'])}), outer "
        f"{_s(d['outer_time_s'])} at {d['inter_island_gbps']:.3g} GB/s (link {_s(d['outer_link_s'])}, host copies "
        f"{_s(d['outer_host_s'])}, update {_s(d['outer_update_s'])}, refresh {_s(d['outer_refresh_s'])}; "
        + ("not overlapped" if d["overlap"].startswith("none") else
           f"delayed: {_s(d['outer_hidden_s'])} of the link hidden behind the next {d['sync_every']} inner steps, "
           f"{_s(d['outer_exposed_s'])} exposed")
        + f"): {_s(d['step_time_s'])} per inner step, {d['outer_fraction']:.1%} in outer steps",
        f"{prefix}: islands: break-even H = {d['break_even_sync_every']} for at most {d['target']:.0%} in outer "
        f"steps; plain dp across the islands: {_s(d['dp_step_time_s'])} per step "
        f"(islands {d['speedup_over_dp']:.3g}x as fast); {match}",
    ]


def _b(n: float) -> str:
    return f"{n / 2**30:.4g} GiB" if n >= 2**30 else f"{n / 2**20:.4g} MiB" if n >= 2**20 else f"{n:,.0f} B"


def _s(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s" if s < 100 else f"{s:,.0f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-4 else f"{s * 1e6:.3g} us"


def default_link(dev, ranks: int, gbps: float | None, target: float | None) -> tuple[LinkSpec, str]:
    """The link: ``gbps`` GB/s if given, else every rank's share of the profile's inter-node bandwidth
    (islands on their own nodes); and a note saying which. ConfigError when neither is known.
    ``target`` None: :data:`DEFAULT_TARGET`."""
    target = DEFAULT_TARGET if target is None else target
    if gbps is not None:
        return LinkSpec(gbps * 1e9, dev.inter_node_latency, target).check(), "given"
    if dev.inter_node_bandwidth > 0:
        return (LinkSpec(ranks * dev.inter_node_bandwidth, dev.inter_node_latency, target).check(),
                "the profile's inter-node bandwidth per device x ranks per island")
    raise ConfigError("no inter-island bandwidth: the profile declares no inter-node bandwidth; give "
                      "--inter-island-bw GBps (GB/s of each island's link to the others)")
