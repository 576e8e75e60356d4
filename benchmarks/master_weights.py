"""Memory and loss-curve difference of bfloat16 training without master weights, one process.

Trains the same tiny model in bfloat16 for ``--steps`` steps with float32 master weights, then
without them (``train.master_weights = "none"``) under each ``train.bf16_update``; counts the
bytes per parameter the engine holds for parameters, masters and optimizer state (its tensors:
``Bucket.full``, ``Bucket.master``, ``Bucket.state``) and prints the loss-curve difference to
the float32-master run (largest and mean absolute per-step difference).

    python benchmarks/master_weights.py --steps 200 --lr 3e-3
"""

from __future__ import annotations

import argparse
import functools
import io

MODEL = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}
MODES = (("float32", "-"), ("none", "stochastic"), ("none", "kahan"), ("none", "nearest"))


@functools.cache
def _backend():
    """CHIPSET_BACKEND (else the best available), its device and a process group of one, once."""
    from chipset.train.rank import start

    return start()


def _config(master: str, update: str, state_dtype: str, steps: int, lr: float):
    from chipset.train.config import RunConfig

    return RunConfig.from_dict({"model": MODEL, "train": {
        "steps": steps, "global_batch": 8, "seq_len": 32, "lr": lr, "seed": 3, "dtype": "bfloat16",
        "optimizer_state_dtype": state_dtype, "master_weights": master,
        **({} if update == "-" else {"bf16_update": update})}}).validate(world_size=1)


def bytes_per_param(master: str, update: str, state_dtype: str) -> float:
    """Bytes the engine holds per parameter for parameters, masters and optimizer state."""
    from chipset.train import build

    engine, _, _ = build(_config(master, update, state_dtype, 1, 1e-3), _backend())
    held = {}  # by storage: without masters the master is a view of the parameters
    for b in engine.buckets:
        for t in (b.full, b.master, *b.state.values()):
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(held.values()) / sum(p.numel() for p in engine.model.parameters())


def losses(master: str, update: str, steps: int, lr: float) -> list[float]:
    from chipset.train import train

    return train(_config(master, update, "float32", steps, lr), _backend(), None, out=io.StringIO()).losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    print(f"backend {_backend().name}, {args.steps} steps at lr {args.lr:g}")
    print("| master weights | bf16_update | bytes/param (fp32 moments) | bytes/param (bf16 moments) "
          "| loss at last step | max abs loss diff | mean abs loss diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ref = None
    for master, update in MODES:
        got = losses(master, update, args.steps, args.lr)
        ref = ref or got
        diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
        print(f"| {master} | {update} | {bytes_per_param(master, update, 'float32'):.2f} | "
              f"{bytes_per_param(master, update, 'bfloat16'):.2f} | {got[-1]:.4f} | {max(diffs):.4f} | "
              f"{sum(diffs) / len(diffs):.4f} |", flush=True)

if __name__ == "__main__":
    main()
