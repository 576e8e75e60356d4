"""What routing every linear layer through the ``linear`` kernel slot costs per call (parallel/linear.py).

    python benchmarks/linear_dispatch.py [--reps 7] [--calls 20000]

Times the forward of one tiny linear layer (8 x 16 @ 16 x 16, where the call overhead is all
there is) built five ways, in turn within each repetition (so load on a shared host falls on all
alike), and prints the median time per call and its ratio to ``nn.Linear``:

* ``nn.Linear``: the layer before the slot;
* ``routed, reference``: a :class:`KernelLinear` bound to ``KernelRegistry.resolve("linear")``
  with nothing registered (``F.linear``: every backend that registers no GEMM);
* ``routed, backend fn``: bound to a registered, always-available Python function (a backend's
  GEMM; here ``F.linear`` underneath, so only the extra frame is timed);
* ``routed, predicate``: bound to an implementation with an availability predicate (the
  dispatcher checks it on each call);
* ``registry per call``: ``kernels.linear(x, w, b)``, the attribute read every other kernel call
  of a layer makes (the registry keeps the dispatcher its first read built, so this is the kept
  function plus an attribute lookup; until 2026-12-07 it was a full lookup and selection per call).

Then the forward and backward of the built-in transformer (2 layers, hidden 64, 2 x 32 tokens)
with its linear layers as ``nn.Linear`` and routed (nothing registered), and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from chipset.kernels import KernelRegistry
from chipset.parallel.linear import KernelLinear, apply_linear


def _backend_fn(x, weight, bias=None):
    return F.linear(x, weight, bias)


def layers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(16, 16)
    out = {"nn.Linear": base}
    plain = KernelRegistry("bench")
    fn = KernelRegistry("bench")
    fn.register("linear", _backend_fn)
    pred = KernelRegistry("bench")
    pred.register("linear", _backend_fn, available=lambda x, weight, bias=None: x.is_floating_point())
    for name, reg in (("routed, reference", plain), ("routed, backend fn", fn), ("routed, predicate", pred)):
        m = nn.Linear(16, 16)
        m.load_state_dict(base.state_dict())
        out[name] = KernelLinear.replacing(m, reg.resolve("linear"))

    class PerCall(nn.Linear):
        def forward(self, x):
            return plain.linear(x, self.weight, self.bias)

    m = PerCall(16, 16)
    m.load_state_dict(base.state_dict())
    out["registry per call"] = m
    return out


def per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def model_step(routed: bool):
    from chipset.models.config import ModelConfig
    from chipset.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=64)
    kernels = KernelRegistry("bench")
    model = Transformer(cfg, kernels)
    if routed:
        model = apply_linear(model, kernels)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def step():
        model(tokens).float().square().mean().backward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mods = layers()
    x = torch.randn(8, 16)
    with torch.no_grad():
        want = mods["nn.Linear"](x)
        assert all(torch.equal(m(x), want) for m in mods.values()), "a routed layer computes something else"
    times: dict[str, list[float]] = {k: [] for k in mods}
    with torch.no_grad():
        for _ in range(a.reps):
            for k, m in mods.items():
                times[k].append(per_call(lambda m=m: m(x), a.calls))
    base = statistics.median(times["nn.Linear"])
    print(f"{'one layer, forward':<22} {'us/call':>8} {'x nn.Linear':>12}")
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"{k:<22} {med * 1e6:8.2f} {med / base:12.3f}")

    steps = {"nn.Linear": model_step(False), "routed": model_step(True)}
    st: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.reps):
        for k, f in steps.items():
            st[k].append(per_call(f, 20))
    b = statistics.median(st["nn.Linear"])
    print(f"\n{'transformer fwd+bwd':<22} {'ms/step':>8} {'x nn.Linear':>12}")
    for k, ts in st.items():
        med = statistics.median(ts)
        print(f"{k:<22} {med * 1e3:8.2f} {med / b:12.3f}")


if __name__ == "__main__":
    main()
