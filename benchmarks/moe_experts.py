"""A MoE layer's experts: chipset's ``MoE`` (the ``grouped_mlp`` kernel on the ``cpu`` backend) vs the plain
PyTorch MoE block users write (a ``ModuleList`` of expert MLPs and a loop over the experts that
received tokens, as Hugging Face's Mixtral/Qwen2-MoE blocks do), forward + backward.

Both get the same router and expert weights (copied from chipset's layer into the peer, which
never imports chipset for its computation) and the same input; the routing is top-k softmax
without capacity, so both compute the same function (checked before timing: outputs and input
gradients agree to float32 rounding). The two alternate repetition by repetition; the table
gives the median seconds per forward + backward and the ratio peer / chipset (> 1: chipset
faster), with the load average: wall-clock time, and this process's CPU time (one thread,
so the same work; unlike wall-clock time it does not count the time a busy machine's other
processes hold the cores, though they still share its caches and memory bandwidth), and the
memory each forward keeps for its backward (activations; parameters excluded).

    OMP_NUM_THREADS=1 python benchmarks/moe_experts.py [--tokens 2048] [--hidden 256]
        [--ffn 512] [--experts 8] [--top-k 2] [--reps 7] [--iters 5] [--unfused]

``--unfused`` adds chipset's layer without the ``grouped_mlp`` kernel (its other path: three
``grouped_mm`` calls around ``swiglu``, what the layer ran before that kernel) as a third side.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class PlainExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PlainMoE(nn.Module):
    """The loop a user writes: route, then each expert takes the tokens sent to it."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(PlainExpert(hidden, ffn) for _ in range(experts))

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view(b, s, h)


def chipset_moe(hidden: int, ffn: int, experts: int, top_k: int):
    from chipset.layers.moe import MoE
    from chipset.loader import backend

    cfg = SimpleNamespace(num_experts=experts, num_experts_per_tok=top_k, router="softmax", capacity_factor=0.0,
                          norm_topk_prob=True, hidden_size=hidden, moe_intermediate_size=ffn, intermediate_size=ffn,
                          shared_expert_intermediate_size=0)
    b = backend(os.environ.get("CHIPSET_BACKEND", "cpu"))
    layer = MoE(cfg, b.kernels)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return layer, b


def copy_into(peer: PlainMoE, layer) -> None:
    with torch.no_grad():
        peer.router.weight.copy_(layer.router.weight)
        for e, ex in enumerate(peer.experts):
            ex.gate_proj.weight.copy_(layer.experts.gate_proj[e])
            ex.up_proj.weight.copy_(layer.experts.up_proj[e])
            ex.down_proj.weight.copy_(layer.experts.down_proj[e])


def step(module, x):
    x = x.detach().requires_grad_(True)
    y = module(x)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def unfused_copy(layer, kernels):
    """A copy of ``layer`` whose experts see the backend's kernels less ``grouped_mlp``: the
    layer's other path, three ``grouped_mm`` calls around ``swiglu``."""
    from chipset.kernels import KernelRegistry

    registry = KernelRegistry(kernels.backend)
    for name in kernels.names():
        for impl in kernels.implementations(name) if name != "grouped_mlp" else ():
            registry.register(name, impl.fn, priority=impl.priority, available=impl.available,
                              description=impl.description)
    other = copy.deepcopy(layer)
    other.experts._k = registry
    return other


def saved_mib(module, x) -> float:
    """MiB the forward keeps for the backward: distinct storages, the module's parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().requires_grad_(True))
    return sum(seen.values()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--unfused", action="store_true",
                    help="also time chipset's layer without the grouped_mlp kernel (grouped_mm, swiglu, grouped_mm)")
    a = ap.parse_args()
    layer, b = chipset_moe(a.hidden, a.ffn, a.experts, a.top_k)
    peer = PlainMoE(a.hidden, a.ffn, a.experts, a.top_k)
    copy_into(peer, layer)
    unfused = unfused_copy(layer, b.kernels) if a.unfused else None  # before a forward leaves non-leaf tensors
    x = torch.randn(4, a.tokens // 4, a.hidden, generator=torch.Generator().manual_seed(1))
    (yc, gc), (yp, gp) = step(layer, x), step(peer, x)
    torch.testing.assert_close(yc, yp, rtol=1e-4, atol=1e-5)  # the same function
    torch.testing.assert_close(gc, gp, rtol=1e-4, atol=1e-5)
    if unfused is not None:
        torch.testing.assert_close(step(unfused, x), (yc, gc), rtol=1e-4, atol=1e-5)
    ex = layer.experts
    ws = [w.transpose(1, 2) for w in (ex.gate_proj, ex.up_proj, ex.down_proj)]
    kernel = b.kernels.select("grouped_mlp", x.reshape(-1, a.hidden), *ws,
                              torch.full((a.experts,), a.tokens, dtype=torch.int32))
    mods = {"chipset": layer, "plain": peer, **({"unfused": unfused} if a.unfused else {})}
    times: dict[str, list[float]] = {name: [] for name in mods}
    cpu: dict[str, list[float]] = {name: [] for name in mods}
    names = list(mods)
    for rep in range(a.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # each goes first in turn
            mod = mods[name]
            step(mod, x)  # warm
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.iters):
                step(mod, x)
            times[name].append((time.perf_counter() - t0) / a.iters)
            cpu[name].append((time.process_time() - c0) / a.iters)
    c, p = statistics.median(times["chipset"]), statistics.median(times["plain"])
    cc, cp = statistics.median(cpu["chipset"]), statistics.median(cpu["plain"])
    print(f"backend {b.name}, grouped_mlp kernel: {getattr(kernel, '__module__', '?')}.{getattr(kernel, '__name__', '?')}")
    print(f"tokens {a.tokens}, hidden {a.hidden}, ffn {a.ffn}, experts {a.experts}, top-k {a.top_k}, "
          f"{a.reps} reps x {a.iters} iters, load average {os.getloadavg()[0]:.2f}")
    print(f"chipset MoE   {1e3 * c:8.2f} ms per forward+backward ({1e3 * cc:.2f} ms CPU time)")
    print(f"plain PyTorch {1e3 * p:8.2f} ms per forward+backward ({1e3 * cp:.2f} ms CPU time)")
    print(f"ratio plain / chipset: {p / c:.2f}x (CPU time: {cp / cc:.2f}x)")
    print(f"saved for the backward: chipset {saved_mib(layer, x):.1f} MiB, plain PyTorch {saved_mib(peer, x):.1f} MiB")
    if a.unfused:
        u, cu = statistics.median(times["unfused"]), statistics.median(cpu["unfused"])
        print(f"chipset unfused {1e3 * u:6.2f} ms per forward+backward ({1e3 * cu:.2f} ms CPU time), "
              f"{saved_mib(mods['unfused'], x):.1f} MiB saved; unfused / chipset: {u / c:.2f}x (CPU time: {cu / cc:.2f}x)")


if __name__ == "__main__":
    main()
