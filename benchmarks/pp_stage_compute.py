"""Per-micro-batch compute of each pipeline stage: chipset's stages vs the plain script's, one process.

Size M of vs_plain_torch.py (hidden 256, 4 blocks, 8/4 heads, SwiGLU 688, vocab 1024), one
micro-batch of 4 x 128 tokens, fp32, one thread. Stage 1 of 2 (blocks 2-3, norm, logits,
loss) runs forward + backward from a hidden-state input; stage 0 (embedding, blocks 0-1) from
token ids with a unit output gradient. chipset's side is its ``UnitStageModel`` on the ``cpu``
backend's kernels; the plain side is benchmarks/plain_torch_lm.py's ``Stage``. Each is warmed
up, then timed 15 times; the table prints the medians, twice, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/pp_stage_compute.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

import chipset
from chipset.models.family import TransformerFamily, bind
from chipset.parallel.stages import UnitStageModel, split_units
from chipset.train.config import load_config

HIDDEN, LAYERS, HEADS, KV, FFN, VOCAB, SEQ, BATCH = 256, 4, 8, 4, 688, 1024, 128, 4


def _plain():
    spec = importlib.util.spec_from_file_location("plain_torch_lm", Path(__file__).with_name("plain_torch_lm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    torch.set_num_threads(1)
    plain = _plain()
    a = argparse.Namespace(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV, ffn=FFN, seq=SEQ)
    cfg = load_config(None, [f"model.vocab_size={VOCAB}", f"model.hidden_size={HIDDEN}",
                             f"model.num_hidden_layers={LAYERS}", f"model.num_attention_heads={HEADS}",
                             f"model.num_key_value_heads={KV}", f"model.intermediate_size={FFN}",
                             f"model.max_position_embeddings={SEQ}", f"train.seq_len={SEQ}"])
    family = TransformerFamily()
    model = bind(family, family.build(cfg, chipset.backend("cpu").kernels), cfg)
    specs = split_units(model, 2)
    first, last = UnitStageModel(model, [specs[0]]), UnitStageModel(model, [specs[1]])
    p_first, p_last = plain.Stage(a, 0, LAYERS // 2, True, False), plain.Stage(a, LAYERS // 2, LAYERS, False, True)
    tokens, targets = torch.randint(VOCAB, (BATCH, SEQ)), torch.randint(VOCAB, (BATCH, SEQ))
    hidden = torch.randn(BATCH, SEQ, HIDDEN)

    def chipset_last():
        x = hidden.clone().requires_grad_(True)
        last.loss(last.chunk_forward(0, x), targets).backward()

    def plain_last():
        x = hidden.clone().requires_grad_(True)
        plain.loss_fn(p_last(x), targets).backward()

    def chipset_first():
        out = first.chunk_forward(0, tokens)
        out.backward(torch.ones_like(out))

    def plain_first():
        out = p_first(tokens)
        out.backward(torch.ones_like(out))

    runs = [("stage 1 (blocks 2-3, head, loss)", chipset_last, plain_last),
            ("stage 0 (embedding, blocks 0-1)", chipset_first, plain_first)]
    print("| stage | chipset ms | plain ms | chipset / plain |\n|---|---|---|---|")
    for name, c, p in runs * 2:
        med = []
        for f in (c, p):
            for _ in range(3):
                f()
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            med.append(statistics.median(ts) * 1e3)
        print(f"| {name} | {med[0]:.1f} | {med[1]:.1f} | {med[0] / med[1]:.2f} |")


if __name__ == "__main__":
    main()
