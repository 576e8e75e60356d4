"""chipset's transformer against the plain script's model: one micro-batch's forward and backward.

One process, one thread, no parallelism: chipset's reference decoder (``Transformer``, every
primitive through the backend's kernel registry) and ``plain_torch_lm.py``'s ``Stage`` (stock
torch modules and functions, the peer of ``vs_plain_torch.py``) at the same size, the same
micro-batch, alternating call by call so that machine noise hits both alike. Prints the median
time of each and the ratio chipset / plain (below 1.00 chipset is faster). What it isolates: the
model's own cost, kernel dispatch included, without an engine, a schedule or communication.

    CHIPSET_BACKEND=cpu python benchmarks/model_vs_plain.py [--size S|M|L] [--iters 150] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch
from plain_torch_lm import Stage, loss_fn
from vs_plain_torch import SIZES

from chipset.loader import backend
from chipset.models.config import ModelConfig
from chipset.models.transformer import Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="S")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: 128, 256 for L)")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    h, n, heads, kv, ffn, vocab = SIZES[a.size]
    seq = a.seq or (256 if a.size == "L" else 128)
    b = backend()
    cfg = ModelConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=seq)
    chipset_model = Transformer(cfg, b.kernels)
    plain = Stage(types.SimpleNamespace(hidden=h, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, seq=seq),
                  0, n, True, True)
    sides = {"chipset": lambda x, y: chipset_model.loss(x, y).backward(),
             "plain": lambda x, y: loss_fn(plain(x), y).backward()}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(a.iters + 2):  # the first two of each: warm-up
        d = torch.randint(vocab, (a.micro_batch, seq + 1), generator=g)
        x, y = d[:, :-1], d[:, 1:]
        for name in (("chipset", "plain") if i % 2 == 0 else ("plain", "chipset")):
            t0 = time.perf_counter()
            sides[name](x, y)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    out = {"size": a.size, "backend": b.name, "iters": a.iters, "chipset_ms": med["chipset"] * 1e3,
           "plain_ms": med["plain"] * 1e3, "ratio": med["chipset"] / med["plain"]}
    print(f"{a.size} on {b.name}: chipset {out['chipset_ms']:.2f} ms, plain {out['plain_ms']:.2f} ms, "
          f"ratio {out['ratio']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
