"""A run measured on any backend, projected onto a named device profile (``chipset train --project PROFILE``).

The simulator runs the real engine and counts, per step and rank, the calls and bytes of every
collective type (``metrics.jsonl``'s ``comm``). The projection puts the same work through the
planner's cost model on the profile (one node of ``world size`` devices):

- compute: the planner's per-micro-batch time of the busiest stage (:func:`chipset.planner.time.evaluate`:
  matmul FLOPs / (peak FLOP/s for the run's dtype x the gemm efficiency model) plus the memory-bound
  element-wise work), times the micro-batches, plus the pipeline bubble and the optimizer's memory-bound
  update. The FLOPs are the planner's count for the run's model and tokens (``flops.step_flops``).
- communication: for each collective type, the bytes the simulator counted on the busiest rank through
  the planner's ring model: a call over n ranks costs ``latency_steps(op, n)`` x intra-node latency, and
  its bytes move at the profile's intra-node bandwidth; the counted bytes are each call's input, so a
  rank sends 2(n-1)/n of them for an all-reduce, (n-1)/n for a reduce-scatter or all-to-all, (n-1)x for
  an all-gather (its input is one shard) and half of a batched send/receive (the other half arrives).
  n is the degree of the dimension that uses the collective (the largest, if several do).
- launches: compute is never below the kernels' launch floor and every step pays the profile's host
  overhead (see :func:`chipset.planner.time.launch_floor`), so a tiny model is not projected faster
  than its kernels can be issued.
- overlap: the data-parallel gradient reduction and ZeRO's parameter gathers follow the planner's dp
  overlap rule (:func:`chipset.planner.time.dp_exposed_time`) when no other dimension uses the same
  collective type; everything else (the loss and gradient-norm all-reduces included) is on the
  critical path.
- per collective type (``comm_ops``): the busiest rank's seconds, the dimensions that issue it (``dims``;
  several when they share the type, e.g. dp's and tp's all-reduces) and its exposed seconds
  (``exposed_s``: the dp-overlapped types share the dp rule's exposed time in proportion to their
  seconds), so ``chipset diagnose`` can compare each group's measured time with its prediction.
"""

from __future__ import annotations

from typing import Any

from chipset.errors import ConfigError
from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster
from chipset.planner.comm import CommItem, latency_steps
from chipset.planner.flops import forward_flops_per_token, model_flops_per_token
from chipset.planner.run import from_run_config
from chipset.planner.time import dp_exposed_time, evaluate

__all__ = ["project", "resolve_profile", "format_mfu", "format_projection"]


def resolve_profile(name: str, dtype: str):
    """The profile's DeviceProperties; ConfigError (exit 2) naming the known profiles, or the dtypes it rates."""
    from chipset.discovery.profiles import all_profiles

    table = all_profiles()
    if name not in table:
        raise ConfigError(f"--project {name!r}: unknown device profile; known profiles: "
                          f"{', '.join(sorted(table)) or '(none)'} (chipset plan --list-profiles shows them)")
    props = table[name][1]
    if props.peak_flops_for(dtype) <= 0:
        raise ConfigError(f"--project {name!r}: the profile declares no peak FLOP/s for train.dtype {dtype!r} "
                          f"(it declares {', '.join(props.peak_flops) or 'none'}); choose another profile or dtype")
    return props


# The collectives of ZeRO's gradient reduction and parameter gathers, which the dp overlap rule covers.
_DP_OVERLAPPED = {0: {"all_reduce"}, 1: {"all_reduce", "all_gather"}, 2: {"reduce_scatter", "all_gather"},
                  3: {"reduce_scatter", "all_gather"}}


def _ops_by_dim(lay, zero: int, sp: bool, cp_attention: str) -> dict[str, set[str]]:
    """Collective types each active dimension issues in the engine."""
    out: dict[str, set[str]] = {}
    if lay.dp * lay.cp > 1:  # the loss and the gradient norm are all-reduced over dp at every stage
        out["dp"] = {"all_reduce"} | _DP_OVERLAPPED[zero]
    if lay.tp > 1:
        out["tp"] = {"all_gather", "reduce_scatter", "all_reduce"} if sp else {"all_reduce"}
    if lay.cp > 1:
        out["cp"] = ({"all_gather"} if cp_attention == "allgather" else {"all_to_all"} if cp_attention == "ulysses"
                     else {"all_to_all", "batch_p2p", "send", "recv"} if cp_attention == "hybrid"
                     else {"batch_p2p", "send", "recv"})
    if lay.ep > 1:
        out["ep"] = {"all_to_all"}
    if lay.pp > 1:
        out["pp"] = {"batch_p2p", "send", "recv"}
    return out


def _sent(op: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    if op == "all_gather":
        return (n - 1) * nbytes
    if op == "batch_p2p":
        return nbytes / 2
    if op in ("send", "broadcast"):
        return float(nbytes)
    return 0.0


def project(cfg: Any, world_size: int, comm: dict, profile: str,
            assumptions: Assumptions | None = None) -> dict:
    """The projection of one step of ``cfg`` onto ``profile``.

    ``comm``: one step's ``metrics.jsonl`` ``comm`` record, ``{op: {"calls": [per rank], "bytes": [per rank]}}``.
    """
    a = assumptions or Assumptions()
    tr = cfg.train
    dev = resolve_profile(profile, tr.dtype)
    m, lay, train = from_run_config(cfg, world_size, kernels="fused")
    cl = Cluster(nodes=1, devices_per_node=world_size, device=dev, profile=profile)
    base = evaluate(m, lay, train, cl, a, seq_len=tr.seq_len)
    mb = base.micro_batches
    t_compute = base.breakdown["compute"]  # all micro-batches of the busiest stage
    fw = forward_flops_per_token(m, tr.seq_len)
    extra = {"none": 0, "selective": fw.attention_core, "full": fw.blocks}[lay.recompute]
    fwd_share = fw.total / (3 * fw.total + extra)  # recompute runs inside backward (as evaluate splits it)

    degrees = {"dp": lay.dp * lay.cp, "tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "pp": lay.pp}
    uses = _ops_by_dim(lay, lay.zero, lay.sp, getattr(cfg.parallel, "cp_attention", "allgather"))
    ranks = max((len(v.get("calls", [])) for v in comm.values()), default=0)
    worst = None
    for r in range(ranks):
        dp_items, other, total, by_op = [], 0.0, 0.0, {}
        for op, rec in comm.items():
            calls, nbytes = rec["calls"][r], rec["bytes"][r]
            dims = [d for d, ops in uses.items() if op in ops]
            n = max((degrees[d] for d in dims), default=1)
            steps = latency_steps("send" if op in ("batch_p2p", "send", "recv") else op, n)
            t = calls * steps * dev.intra_node_latency
            bw = dev.intra_node_bandwidth
            t += _sent(op, nbytes, n) / bw if bw > 0 else 0.0
            total += t
            by_op[op] = {"seconds": t, "dims": dims}
            if dims == ["dp"] and op in _DP_OVERLAPPED[lay.zero]:
                phase = _dp_phase(op, lay.zero)
                dp_items.append(CommItem(dim="dp", op=op, what="measured", group_size=n, calls=calls,
                                         bytes=_sent(op, nbytes, n), intra_node=True, time_s=t, phase=phase))
            else:
                other += t
        slot = t_compute / mb + other / mb
        # the slowest stage's slots, as evaluate counts them: (p-1)/v, more when its chunks are uneven,
        # max(p-1, 2p-1-m)/3 for zero_bubble, max(p-1, 4p-2-2m)/6 for zbv
        bubble = slot * base.bubble_slots
        dp_exposed = dp_exposed_time(dp_items, t_compute / mb * fwd_share, t_compute / mb * (1 - fwd_share), mb, a)
        step = slot * mb + bubble + dp_exposed + base.breakdown["optimizer"] + base.breakdown["host"]
        hidden = sum(i.time_s for i in dp_items)
        for op, row in by_op.items():  # the dp overlap rule hides the overlapped ops' time pro rata
            overlapped = row["dims"] == ["dp"] and op in _DP_OVERLAPPED[lay.zero]
            row["exposed_s"] = row["seconds"] * (dp_exposed / hidden if hidden > 0 else 0.0) if overlapped else row["seconds"]
        cand = {"step_time_s": step, "comm_s": total, "comm_exposed_s": other + dp_exposed, "bubble_s": bubble,
                "comm_ops": by_op}
        if worst is None or cand["step_time_s"] > worst["step_time_s"]:
            worst = cand
    if worst is None:  # one rank, nothing communicated
        bubble = 0.0
        worst = {"step_time_s": t_compute + base.breakdown["optimizer"] + base.breakdown["host"], "comm_s": 0.0, "comm_exposed_s": 0.0,
                 "bubble_s": bubble, "comm_ops": {}}
    tokens = tr.global_batch * tr.seq_len
    step = worst["step_time_s"]
    peak = dev.peak_flops_for(tr.dtype)
    return {
        "profile": profile, "dtype": tr.dtype, "devices": world_size,
        "step_time_s": step, "compute_s": t_compute, "comm_s": worst["comm_s"],
        "comm_exposed_s": worst["comm_exposed_s"], "bubble_s": worst["bubble_s"],
        "optimizer_s": base.breakdown["optimizer"], "gemm_efficiency": base.breakdown["gemm_efficiency"],
        "roofline_s": base.breakdown["roofline"], "launch_floor_s": base.breakdown["launch_floor"], "host_s": base.breakdown["host"],
        "comm_ops": worst["comm_ops"],
        "tokens_per_s": tokens / step,
        "mfu": model_flops_per_token(m, tr.seq_len) * tokens / (step * world_size * peak),
    }


def _dp_phase(op: str, zero: int) -> str:
    """When the engine runs a data-parallel collective, in the planner's phase names."""
    if zero == 3:
        return "param_micro" if op == "all_gather" else "grad_micro"
    return "param" if op == "all_gather" else "grad"


def format_projection(p: dict, measured_step_s: float | None = None, measured_tokens_per_s: float | None = None,
                      backend: str = "cpu_sim") -> str:
    """The one line ``chipset train --project`` prints; ``backend``: the one the run was measured on."""
    here = ""
    if measured_step_s:
        here = f"; measured here on {backend}: {measured_step_s:.3g} s/step, {measured_tokens_per_s:.0f} tokens/s"
    return (f"chipset train: projected on {p['devices']} x {p['profile']} ({p['dtype']}): step {_ms(p['step_time_s'])} "
            f"(compute {_ms(p['compute_s'])}, communication {_ms(p['comm_s'])} of which {_ms(p['comm_exposed_s'])} "
            f"exposed, bubble {_ms(p['bubble_s'])}, optimizer {_ms(p['optimizer_s'])}, host {_ms(p['host_s'])}), "
            f"{p['tokens_per_s']:.3g} tokens/s, MFU {format_mfu(p['mfu'])}{here}")


def format_mfu(mfu: float) -> str:
    """MFU as a percentage, with two significant digits below 0.1% (a tiny model's 0.016%
    would print as 0.0%)."""
    return f"{mfu:.1%}" if mfu >= 0.001 else f"{mfu * 100:.2g}%"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-4 else f"{s * 1e6:.3g} us"
