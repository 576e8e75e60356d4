"""chipset's engine in a bare training loop, for ``vs_plain_torch.py --bare-engine``.

The loop has the plain script's shape (benchmarks/plain_torch_lm.py): per step this rank's
micro-batches, ``forward_backward_step`` and ``step``, timed from the data to the update; no
metrics, no signal check, no barriers. Against ``chipset train`` it separates the engine's
speed from what the training loop adds around it. Run by torchrun with 2 ranks; prints one JSON
line on rank 0 (tokens/s over steps 2..N).

    CHIPSET_BACKEND=cpu python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/engine_loop.py --layout pp --hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 344 --vocab 256
"""

from __future__ import annotations

import argparse
import json
import os
import time

from chipset.loader import backend
from chipset.train import build
from chipset.train.config import RunConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=("dp", "zero3", "pp"), default="pp")
    for name, default in (("hidden", 128), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("ffn", 344),
                          ("vocab", 256), ("seq", 128), ("batch", 16), ("steps", 40), ("micro-batches", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    b = backend()
    b.device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    b.collective.init_process_group()
    parallel = {"dp": {}, "zero3": {"zero": 3}, "pp": {"pp": 2, "schedule": "1f1b", "micro_batches": a.micro_batches}}
    cfg = RunConfig.from_dict({
        "model": {"vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
                  "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "intermediate_size": a.ffn,
                  "max_position_embeddings": a.seq},
        "train": {"global_batch": a.batch, "seq_len": a.seq, "lr": 1e-3},
        "parallel": parallel[a.layout],
    }).validate(world_size=b.collective.world_size())
    engine, data, dims = build(cfg, b)
    dev = b.device.torch_device()
    dp_rank = dims.coords(b.collective.rank())["dp"]
    m = engine.micro_batches
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        batches = [data.batch(step, dp_rank, dims.dp, i, m, device=dev) for i in range(m)]
        engine.forward_backward_step(batches)
        engine.step(1e-3)
        b.device.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    if b.collective.rank() == 0:
        print(json.dumps({"tokens_per_s": a.batch * a.seq * len(steady) / sum(steady)}), flush=True)
    b.collective.destroy()


if __name__ == "__main__":
    main()
