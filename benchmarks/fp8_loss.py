"""FP8 training's loss curve against the same run without FP8 (train.fp8), one process.

Trains the same tiny model for ``--steps`` steps in ``--dtype`` without FP8 and with each FP8
scaling (the backend's ``fp8_matmul``; cpu_sim emulates it, kernels/fp8.py), and prints the
last step's loss, the largest per-step loss difference to the run without FP8, and the mean
difference over the last 20 steps.

    CHIPSET_BACKEND=cpu_sim python benchmarks/fp8_loss.py --steps 200
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


def run(fp8: str, dtype: str, steps: int) -> list[float]:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict({"model": MODEL, "train": {
        "steps": steps, "global_batch": 8, "seq_len": 32, "lr": 3e-3, "seed": 3, "dtype": dtype,
        "fp8": fp8}}).validate(world_size=1)
    backend = _backend()
    return train(cfg, backend, None, out=io.StringIO()).losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    ref = run("off", args.dtype, args.steps)
    tail = min(20, args.steps)
    print(f"| train.fp8 | loss at step 1 | loss at step {args.steps} | max abs loss diff | mean abs diff, last {tail} steps |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("off", "tensorwise", "rowwise"):
        losses = ref if mode == "off" else run(mode, args.dtype, args.steps)
        diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
        print(f"| {mode} | {losses[0]:.4f} | {losses[-1]:.4f} | {max(diffs):.4f} | {sum(diffs[-tail:]) / tail:.4f} |")


if __name__ == "__main__":
    main()
