"""Throughput of the token-file loader alone vs a training step that consumes its tokens.

Run: python benchmarks/tokens_loader.py [--tokens 50000000] [--seq-len 1024] [--batch 8]

Writes a flat uint16 token file of --tokens random ids (nanoGPT layout, read through the
same memmap path as prepared folders) in a temporary folder, then measures:
- loader: sequences/s of TokenFiles.batch for one data-parallel rank (random windows of the
  epoch order, so page-cache misses are included on the first pass), as tokens/s;
- step: tokens/s of `chipset train` on the default backend with data.source = tokens on
  the same file (the small default model), as printed in its summary.
The ratio says how many times faster the loader is than the step it feeds; above ~10 the
loader is never the bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args()

    from chipset.cli.main import main as cli
    from chipset.data.datasets import TokenFiles

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "train.bin"
        rng = np.random.default_rng(0)
        with open(f, "wb") as fh:
            for start in range(0, args.tokens, 10_000_000):
                rng.integers(0, 32000, min(10_000_000, args.tokens - start), dtype=np.uint16).tofile(fh)
        data = TokenFiles(str(f), args.seq_len, args.batch, seed=0)
        data.batch(0)  # the epoch order
        t0 = time.perf_counter()
        for i in range(args.batches):
            data.batch(i)
        loader = args.batches * args.batch * args.seq_len / (time.perf_counter() - t0)

        run = Path(tmp) / "run"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli(["train", "--set", "data.source=tokens", "--set", f"data.path={f}", "--set", "model.vocab_size=32000",
                 "--set", f"train.seq_len={args.seq_len}", "--set", f"model.max_position_embeddings={args.seq_len}",
                 "--set", f"train.global_batch={args.batch}", "--set", "train.steps=5", "--run-dir", str(run)])
        step = json.loads((run / "summary.json").read_text())["tokens_per_s"]
    print(json.dumps({"loader_tokens_per_s": round(loader), "train_step_tokens_per_s": round(step),
                      "loader_over_step": round(loader / step, 1), "file_tokens": args.tokens,
                      "seq_len": args.seq_len, "batch": args.batch}, indent=2))


if __name__ == "__main__":
    main()
