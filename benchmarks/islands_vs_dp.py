"""Two islands (DiLoCo, an outer step every H steps) against plain dp=2, at the same tokens, on real text.

    python benchmarks/islands_vs_dp.py [--steps 1000] [--sync-every 20] [--outer-optimizer nesterov]
        [--outer-lr 0.5] [--outer-momentum 0.5] [--json out.json]

Both jobs are ``chipset train --nproc 2`` on the launcher's backend (cpu_sim unless
CHIPSET_BACKEND says otherwise): the same byte-level decoder (vocabulary 256, hidden 64,
2 blocks), the same seed, ``train.global_batch`` sequences of ``train.seq_len`` tokens per
step (the islands split each step's batch between them, as dp=2 splits it between its
ranks), AdamW inner steps; the islands' outer step is chipset's default (Nesterov, lr 0.5,
momentum 0.5; docs/islands.md compares others). The data is real text: the first MiB of the Python standard
library's sources (what ``data.source = "text"`` reads), written as a flat uint16 token file
so the run can hold out its last 5% for evaluation (``data.eval_fraction``).

Printed: each job's final eval loss (the same held-out windows) and the bytes that crossed
between the islands (``cross_island_bytes`` of the islands' summary.json, counted by the
islands' link) beside every byte dp=2's collectives handed over (``comm_totals`` of its
summary.json, ``Collective.comm_stats``): at dp=2 every one of those crosses between the
two ranks. docs/islands.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.vocab_size=256", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=172"]


def text_tokens(out: Path) -> Path:
    """The first MiB of the standard library's sources as a flat uint16 file of byte tokens."""
    from chipset.data.datasets import TextBytes

    data = TextBytes("", seq_len=64, global_batch=1).data.numpy()
    f = out / "stdlib-bytes.bin"
    data.astype("<u2").tofile(f)
    return f


def run(run_dir: Path, sets: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-optimizer", default="nesterov")
    p.add_argument("--outer-lr", type=float, default=0.5)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--skip-dp", type=float, default=None, metavar="EVAL_LOSS",
                   help="do not rerun dp=2: compare with this eval loss (its bytes are not measured then)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="islands-vs-dp-") as tmp:
        tmp = Path(tmp)
        base = [*MODEL, f"train.steps={args.steps}", "train.global_batch=16", "train.seq_len=64", "train.lr=3e-3",
                "train.warmup_steps=20", "train.dtype=\"float32\"", "train.checkpoint_every=0",
                f"train.eval_every={args.steps}", "train.eval_steps=8", "data.source=\"tokens\"",
                f"data.path=\"{text_tokens(tmp)}\"", "data.eval_fraction=0.05"]
        dp = run(tmp / "dp", base) if args.skip_dp is None else {"eval_loss": args.skip_dp, "comm_totals": {}}
        isl = run(tmp / "islands", [*base, "islands.count=2", f"islands.sync_every={args.sync_every}",
                                    f"islands.outer_optimizer=\"{args.outer_optimizer}\"",
                                    f"islands.outer_lr={args.outer_lr}", f"islands.outer_momentum={args.outer_momentum}"])
    dp_bytes = sum(t["bytes"] for t in dp["comm_totals"].values())
    crossed = isl["cross_island_bytes"]
    measured_dp = args.skip_dp is None
    res = {"steps": args.steps, "sync_every": args.sync_every, "dp_eval_loss": dp["eval_loss"],
           "islands_eval_loss": isl["eval_loss"], "eval_loss_ratio": isl["eval_loss"] / dp["eval_loss"],
           "dp_bytes": dp_bytes, "islands_cross_bytes": crossed,
           "bytes_ratio": dp_bytes / crossed if measured_dp else None,
           "outer_optimizer": args.outer_optimizer, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    print(f"steps {args.steps}, H {args.sync_every}, {args.steps * 16 * 64} tokens each; outer step "
          f"{args.outer_optimizer} lr {args.outer_lr} momentum {args.outer_momentum}")
    print(f"eval loss: dp=2 {dp['eval_loss']:.4f}, 2 islands {isl['eval_loss']:.4f} "
          f"(islands / dp = {res['eval_loss_ratio']:.4f})")
    if measured_dp:
        print(f"bytes between the two halves: dp=2 {dp_bytes:,}, 2 islands {crossed:,} "
              f"(dp / islands = {res['bytes_ratio']:.1f}x)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
