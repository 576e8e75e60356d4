"""``chipset train`` on the ``cpu`` backend vs plain PyTorch (benchmarks/plain_torch_lm.py).

For each model size and layout, the two trainers run as separate jobs of 2 ranks,
alternating (chipset first on even repetitions, torch first on odd ones) so that load
from other processes hits both alike. Each job reports steady tokens/s (steps after the
first) and each rank's peak resident memory; the table gives the medians over
repetitions and the ratios chipset / torch (tokens/s: above 1.00 means chipset is
faster; memory: below 1.00 means chipset holds less).

Layouts: ``dp`` (chipset dp=2, ZeRO-0) vs ``DistributedDataParallel``; ``zero3`` (chipset
dp=2, ZeRO-3) vs FSDP2 ``fully_shard``; ``pp`` (chipset pp=2, 1F1B) vs
``torch.distributed.pipelining`` ``Schedule1F1B``, both over ``--pp-micro-batches``.
The plain trainer never imports chipset. Both get ``OMP_NUM_THREADS`` = cores / 2.

``--bare-engine`` adds a third side: chipset's engine in a bare loop of the plain script's shape
(benchmarks/engine_loop.py: no metrics, no signal check), to tell the engine's speed from what
``chipset train``'s loop adds; the three then take turns leading.

    python benchmarks/vs_plain_torch.py [--sizes S,M,L] [--layouts dp,zero3,pp] [--reps 3] \\
        [--steps 10] [--compile] [--bare-engine] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {  # hidden, layers, heads, kv heads, ffn, vocab
    "S": (128, 4, 4, 2, 344, 256),
    "M": (256, 4, 8, 4, 688, 1024),
    "L": (512, 8, 8, 4, 1376, 4096),  # issue 38's larger size (with --seq 256)
}


def _env() -> dict:
    # CHIPSET_CPU_MALLOC (the cpu backend's malloc setting, docs/cpu.md) reaches chipset's ranks;
    # the plain trainer never reads it. glibc's own MALLOC_* variables reach both.
    e = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_") or k == "CHIPSET_CPU_MALLOC"}
    e["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
    return e


def run_chipset(size: str, layout: str, a) -> dict:
    h, n, heads, kv, ffn, vocab = SIZES[size]
    sets = {
        "model.vocab_size": vocab, "model.hidden_size": h, "model.num_hidden_layers": n,
        "model.num_attention_heads": heads, "model.num_key_value_heads": kv, "model.intermediate_size": ffn,
        "model.max_position_embeddings": a.seq, "train.seq_len": a.seq, "train.global_batch": a.batch,
        "train.steps": a.steps, "train.lr": 1e-3, "train.log_every": a.steps,
    }
    if getattr(a, "compile", False):
        sets["train.compile"] = "true"
    if layout == "zero3":
        sets["parallel.zero"] = 3
    if layout == "pp":
        sets.update({"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.micro_batches": a.pp_micro_batches})
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--run-dir", d]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = dict(_env(), CHIPSET_BACKEND=a.backend)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"chipset train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        s = json.loads((Path(d) / "summary.json").read_text())
        first = json.loads((Path(d) / "metrics.jsonl").read_text().splitlines()[0])
    # The first step holds torch.compile's compile time under train.compile (its steps are
    # excluded from tokens/s as every first step is).
    return {"tokens_per_s": s["tokens_per_s"], "peak_rss_bytes": max(s["peak_memory_bytes"]),
            "first_step_s": first["step_time_s"]}


def run_engine(size: str, layout: str, a) -> dict:
    h, n, heads, kv, ffn, vocab = SIZES[size]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "engine_loop.py"), "--layout", layout, "--hidden", str(h), "--layers", str(n),
           "--heads", str(heads), "--kv-heads", str(kv), "--ffn", str(ffn), "--vocab", str(vocab),
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps),
           "--micro-batches", str(a.pp_micro_batches)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(_env(), CHIPSET_BACKEND=a.backend), timeout=1800)
    results = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not results:
        raise SystemExit(f"engine loop failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {"tokens_per_s": json.loads(results[-1])["tokens_per_s"]}


def run_torch(size: str, layout: str, a) -> dict:
    h, n, heads, kv, ffn, vocab = SIZES[size]
    mode = {"dp": "ddp", "zero3": "fsdp2", "pp": "pp"}[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "plain_torch_lm.py"), "--mode", mode, "--hidden", str(h), "--layers", str(n),
           "--heads", str(heads), "--kv-heads", str(kv), "--ffn", str(ffn), "--vocab", str(vocab),
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps),
           "--micro-batches", str(a.pp_micro_batches if layout == "pp" else 1)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1800)
    results = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 and not results:
        raise SystemExit(f"plain torch failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    if r.returncode != 0:
        # Seen once with FSDP2 on gloo (torch 2.13): rank 0 printed its result after the last
        # step and destroy_process_group, then the process aborted at exit ("terminate called
        # without an active exception"). The measurement is complete; say so and keep it.
        print(f"warning: plain torch {mode} exited {r.returncode} after reporting its result (teardown)", file=sys.stderr)
    out = json.loads(results[-1])
    return {"tokens_per_s": out["tokens_per_s"], "peak_rss_bytes": max(out["peak_rss_bytes"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="S,M")
    ap.add_argument("--layouts", default="dp,zero3,pp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pp-micro-batches", type=int, default=4)
    ap.add_argument("--backend", default="cpu", help="chipset backend (cpu; cpu_sim to see the simulator's cost)")
    ap.add_argument("--compile", action="store_true", help="chipset with train.compile = true (per-block torch.compile)")
    ap.add_argument("--bare-engine", action="store_true",
                    help="also time chipset's engine in a bare loop (benchmarks/engine_loop.py)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for size in a.sizes.split(","):
        for layout in a.layouts.split(","):
            sides = [("chipset", run_chipset), ("torch", run_torch)] + ([("engine", run_engine)] if a.bare_engine else [])
            got: dict[str, list[dict]] = {name: [] for name, _ in sides}
            loads = []
            for rep in range(a.reps):
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]  # each side leads in turn
                for name, fn in order:
                    loads.append(os.getloadavg()[0])
                    got[name].append(fn(size, layout, a))
            med = {k: {m: statistics.median(x[m] for x in v) for m in ("tokens_per_s", "peak_rss_bytes")}
                   for k, v in got.items() if k != "engine"}
            engine = statistics.median(x["tokens_per_s"] for x in got["engine"]) if a.bare_engine else None
            row = {"size": size, "layout": layout, "params_hidden_layers": SIZES[size][:2], **{
                f"{k}_{m}": v[m] for k, v in med.items() for m in v},
                "ratio_tokens_per_s": med["chipset"]["tokens_per_s"] / med["torch"]["tokens_per_s"],
                "ratio_peak_rss": med["chipset"]["peak_rss_bytes"] / med["torch"]["peak_rss_bytes"],
                "runs": got, "load_average": [min(loads), max(loads)], "time": time.strftime("%H:%M:%S")}
            if engine is not None:
                row.update(engine_tokens_per_s=engine, ratio_engine_tokens_per_s=engine / med["torch"]["tokens_per_s"])
            rows.append(row)
            print(f"{size} {layout:6} chipset {row['chipset_tokens_per_s']:8.0f} tok/s "
                  f"{row['chipset_peak_rss_bytes'] / 2**20:7.1f} MiB | torch {row['torch_tokens_per_s']:8.0f} tok/s "
                  f"{row['torch_peak_rss_bytes'] / 2**20:7.1f} MiB | ratio tok/s {row['ratio_tokens_per_s']:.3f} "
                  f"mem {row['ratio_peak_rss']:.3f}  (load {min(loads):.1f}-{max(loads):.1f}; "
                  f"tok/s chipset {[round(x['tokens_per_s']) for x in got['chipset']]}, "
                  f"torch {[round(x['tokens_per_s']) for x in got['torch']]})"
                  + (f" | bare engine {engine:8.0f} tok/s, ratio {row['ratio_engine_tokens_per_s']:.3f} "
                     f"{[round(x['tokens_per_s']) for x in got['engine']]}" if engine is not None else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
