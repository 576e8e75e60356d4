"""Training-state memory of one rank with and without LoRA (cpu_sim, one process; docs/hf.md).

Builds the engine of the same small Llama-shaped model twice, full fine-tuning and
``model.lora_rank = R``, and counts the bytes the engine allocated for training state: fp32
master weights, optimizer moments (AdamW: two per trained element) and gradient buffers.
Nothing is timed; the counts are exact.

    python benchmarks/lora_memory.py [--rank 8] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os

MODEL = ["model.vocab_size=4096", "model.hidden_size=512", "model.num_hidden_layers=4",
         "model.num_attention_heads=8", "model.intermediate_size=1376", "train.dtype=bfloat16",
         "train.seq_len=64", "train.global_batch=1"]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(b, sets: list[str]) -> dict[str, int]:
    """Element and byte counts of the engine ``sets`` configure (one rank)."""
    from chipset.train.config import load_config
    from chipset.train.loop import build

    cfg = load_config(None, sets).validate(world_size=1, dtypes=b.capabilities.dtypes)
    engine, _, _ = build(cfg, b)
    trained = [bk for bk in engine.buckets if not bk.frozen]
    return {
        "params": sum(p.numel() for p in engine.model.parameters()),
        "trained": sum(p.numel() for bk in trained for p in bk.params),
        "master": _bytes(bk.master for bk in trained if not bk.master_aliases_params),
        "moments": _bytes(t for bk in trained for t in bk.state.values()),
        "grads": _bytes(t for bk in trained for t in (bk.grad, bk.grad_shard_buf)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=8, help="model.lora_rank of the LoRA run (default 8)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = ap.parse_args(argv)
    os.environ.setdefault("CHIPSET_BACKEND", "cpu_sim")
    from chipset.loader import backend

    b = backend()
    b.device.set_device(0)
    b.collective.init_process_group()
    full = measure(b, MODEL + args.set)
    lora = measure(b, MODEL + args.set + [f"model.lora_rank={args.rank}"])
    print(f"{'':24}{'full fine-tune':>16}{f'LoRA rank {args.rank}':>16}{'ratio':>9}")
    for key, what in (("params", "parameters"), ("trained", "trained parameters"), ("master", "fp32 masters (B)"),
                      ("moments", "AdamW moments (B)"), ("grads", "gradient buffers (B)")):
        ratio = f"{lora[key] / full[key]:.4f}" if full[key] else "-"
        print(f"{what:24}{full[key]:>16,}{lora[key]:>16,}{ratio:>9}")
    b.collective.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
