"""Optimizer-state memory and loss-curve difference of train.optimizer_state_dtype, one process.

Trains the same tiny model for ``--steps`` steps with float32, bfloat16 and int8 optimizer state
(AdamW, then Muon), counts the optimizer state's bytes from the engine's tensors
(``Bucket.state``), and prints the largest per-step loss difference to the float32 run.

    python benchmarks/optimizer_state.py --steps 100
"""

from __future__ import annotations

import argparse
import functools
import io

MODEL = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}


@functools.cache
def _backend():
    """CHIPSET_BACKEND (else the best available), its device and a process group of one, once."""
    from chipset.train.rank import start

    return start()


def run(optimizer: str, state_dtype: str, steps: int) -> tuple[list[float], int]:
    from chipset.train import build, train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict({"model": MODEL, "train": {
        "steps": steps, "global_batch": 8, "seq_len": 32, "lr": 3e-3, "seed": 3, "optimizer": optimizer,
        "optimizer_state_dtype": state_dtype}}).validate(world_size=1)
    backend = _backend()
    engine, _, _ = build(cfg, backend)
    state_bytes = sum(t.nbytes for b in engine.buckets for t in b.state.values())  # int8: codes + scales
    losses = train(cfg, backend, None, out=io.StringIO()).losses
    return losses, state_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    print("| optimizer | state dtype | state bytes | vs float32 | loss at last step | max abs loss diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for opt in ("adamw", "muon"):
        ref, ref_bytes = run(opt, "float32", args.steps)
        for sd in ("float32", "bfloat16", "int8"):
            losses, nbytes = (ref, ref_bytes) if sd == "float32" else run(opt, sd, args.steps)
            diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
            print(f"| {opt} | {sd} | {nbytes} | {nbytes / ref_bytes:.2f} | {losses[-1]:.4f} | {diff:.4f} |")


if __name__ == "__main__":
    main()
