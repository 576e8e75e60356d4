"""chipset's federated FedAvg vs Flower's FedAvg: same model, start, client shards, rounds and local SGD steps.

    python benchmarks/federated_vs_flower.py [--reps 3] [--rounds 10] [--local-steps 10] [--secure]
        [--peer-path DIR] [--workdir runs/federated_vs_flower] [--json OUT]

Needs Flower (``flwr``). Without touching the environment chipset runs in:
``python -m pip install --target DIR flwr`` and pass ``--peer-path DIR`` (appended to the end of
``sys.path`` in the Flower processes only, so the environment's torch and numpy win).

The task: a byte-level decoder (the federated example's shapes: vocabulary 256, hidden 32, 2 blocks,
2 heads, FFN 64; float32) learns Python source. Four clients, each with its own text (the ``.py``
files of one standard-library package: json, email, http, logging; non-IID), the first 44,000 bytes
for training and the next 4,096 into one held-out file shared by all. Both sides start from the same
weights (drawn here in plain torch, written as a Hugging Face folder: chipset's ``model.init_from``,
Flower's initial parameters), read the same windows in the same order (chipset's token-file rule:
window ``perm[i]`` of ``numpy.random.default_rng([data.seed, 0]).permutation``, client ``c`` taking
sequences ``s*G + c*G/4 ..`` of step ``s``), and take ``--local-steps`` plain SGD steps (no
momentum, gradient clipped to norm 1.0, constant lr) per round; a round averages the four models
with equal weights (FedAvg).

- chipset: ``chipset train --nproc 4`` with ``islands.count = 4``, outer SGD at lr 1 (``--secure``
  adds a row with ``islands.secure_aggregation = true``; its ``clip_norm`` of 1000 never binds),
  four client processes on the ``cpu`` backend meeting over gloo;
- Flower: ``flwr.server.start_server`` with its ``FedAvg`` strategy and four ``flwr.client.start_client``
  processes with a ``NumPyClient`` over gRPC on loopback, plain torch (benchmarks/plain_torch_lm.py's
  model, which never imports chipset).

Repetitions alternate (chipset, Flower, chipset, ...). Printed per run: wall time of the whole job
(launch to exit of every process), training time from round 2 on (chipset: island 0's summed
``step_time_s`` of those steps, outer steps included; Flower: the server's time from sending each
round's parameters to having aggregated the replies; round 1 is left out because there each side's
processes still start up, load and wait for each other differently), the eval loss of the
final global model on every window of the held-out file (the same plain-torch evaluation for both;
chipset's from ``chipset export --format hf``), the bytes of model payload per round (chipset:
``cross_island_bytes``, what the clients handed to the all-reduce; Flower: the serialized
parameters the server sent and received), the CPU seconds of all the job's processes, and client
0's loss on the last local step of round 1 (the same weights, batches and SGD steps before any
averaging: equal up to kernel rounding, or the two are not training the same thing).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = SimpleNamespace(vocab=256, hidden=32, layers=2, heads=2, kv_heads=2, ffn=64, seq=64)
CLIENTS, PACKAGES = 4, ("json", "email", "http", "logging")
TRAIN_BYTES, HELD_BYTES = 44_000, 4_096
BATCH, LR, CLIP, INIT_SEED, DATA_SEED = 16, 0.3, 1.0, 7, 0
FEDAVG = ["islands.outer_optimizer=\"sgd\"", "islands.outer_lr=1.0"]
SECURE = ["islands.secure_aggregation=true", "islands.clip_norm=1000.0"]


# --- the peer's side: plain torch and numpy, no chipset -----------------------------------


def build_model():
    import torch
    from plain_torch_lm import Stage

    return Stage(SimpleNamespace(**vars(SHAPE)), 0, SHAPE.layers, True, True).to(torch.float32)


def hf_names() -> dict[str, str]:
    """plain_torch_lm's parameter names -> Hugging Face Llama names."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    parts = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i in range(SHAPE.layers):
        for ours, theirs in parts.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    return names


def write_hf(model, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({hf: model.state_dict()[ours].contiguous() for ours, hf in hf_names().items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": SHAPE.vocab,
        "hidden_size": SHAPE.hidden, "intermediate_size": SHAPE.ffn, "num_hidden_layers": SHAPE.layers,
        "num_attention_heads": SHAPE.heads, "num_key_value_heads": SHAPE.kv_heads, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": SHAPE.seq, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32"}, indent=1))


def read_hf(model, folder: Path):
    from safetensors.torch import load_file

    got = load_file(str(folder / "model.safetensors"))
    model.load_state_dict({ours: got[hf] for ours, hf in hf_names().items()})
    return model


def tokens(path: Path):
    import numpy as np

    return np.fromfile(path, dtype="<u2").astype("int64")


def client_batch(data, step: int, client: int):
    """Client ``client``'s sequences of global step ``step`` (0-based), as chipset's token files give them."""
    import numpy as np
    import torch

    n = (len(data) - 1) // SHAPE.seq
    per = BATCH // CLIENTS
    first = step * BATCH + client * per
    rows = []
    for i in range(first, first + per):
        epoch, j = divmod(i, n)
        w = int(np.random.default_rng([DATA_SEED, epoch]).permutation(n)[j]) * SHAPE.seq
        rows.append(torch.from_numpy(data[w:w + SHAPE.seq + 1]))
    seqs = torch.stack(rows)
    return seqs[:, :-1], seqs[:, 1:]


def eval_loss(folder: Path, held: Path) -> float:
    """Mean next-token loss of the model in ``folder`` over every window of the held-out file."""
    import torch
    import torch.nn.functional as F

    model = read_hf(build_model(), folder).eval()
    data = torch.from_numpy(tokens(held))
    n = (len(data) - 1) // SHAPE.seq
    seqs = torch.stack([data[w * SHAPE.seq:w * SHAPE.seq + SHAPE.seq + 1] for w in range(n)])
    with torch.no_grad():
        logits = model(seqs[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, SHAPE.vocab), seqs[:, 1:].reshape(-1)))


def flower_client(port: int, client: int, data_path: Path, local_steps: int, out: Path) -> None:
    import flwr
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model, data = build_model(), tokens(data_path)
    keys = list(model.state_dict())
    round1: list[float] = []  # its loss on the last local step of round 1

    class Client(flwr.client.NumPyClient):
        def fit(self, parameters, config):
            model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in zip(keys, parameters, strict=True)})
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
            r = int(config["round"])
            for step in range((r - 1) * local_steps, r * local_steps):
                x, y = client_batch(data, step, client)
                loss = F.cross_entropy(model(x).reshape(-1, SHAPE.vocab), y.reshape(-1))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                if step == local_steps - 1:
                    round1.append(float(loss.detach()))
            return [v.detach().numpy().copy() for v in model.state_dict().values()], int(x.shape[0]) * local_steps, {}

    flwr.client.start_client(server_address=f"127.0.0.1:{port}", client=Client().to_client(), insecure=True)
    out.write_text(json.dumps({"round1_loss": round1[0] if round1 else None}))


def flower_server(port: int, rounds: int, init: Path, out: Path) -> None:
    import flwr
    import torch

    torch.set_num_threads(1)
    model = read_hf(build_model(), init)
    start = [v.numpy() for v in model.state_dict().values()]
    stats = {"bytes_per_round": [], "round_s": []}
    clock = {}

    class Avg(flwr.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            got = super().configure_fit(server_round, parameters, client_manager)  # waits for the clients
            clock[server_round] = time.perf_counter()
            stats["bytes_per_round"].append(sum(len(t) for _, ins in got for t in ins.parameters.tensors))
            return got

        def aggregate_fit(self, server_round, results, failures):
            if failures:
                raise SystemExit(f"round {server_round}: {len(failures)} client(s) failed: {failures[:1]}")
            stats["bytes_per_round"][-1] += sum(len(t) for _, res in results for t in res.parameters.tensors)
            agg, metrics = super().aggregate_fit(server_round, results, failures)
            stats["round_s"].append(time.perf_counter() - clock[server_round])
            if server_round == rounds:
                final = flwr.common.parameters_to_ndarrays(agg)
                model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in zip(model.state_dict(), final, strict=True)})
                write_hf(model, out.parent / "final")
            return agg, metrics

    strategy = Avg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=CLIENTS, min_evaluate_clients=0,
                   min_available_clients=CLIENTS, on_fit_config_fn=lambda r: {"round": r},
                   initial_parameters=flwr.common.ndarrays_to_parameters(start))
    t0 = time.perf_counter()
    flwr.server.start_server(server_address=f"127.0.0.1:{port}", config=flwr.server.ServerConfig(num_rounds=rounds),
                             strategy=strategy)
    stats["train_s"] = time.perf_counter() - clock[1]
    stats["server_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(stats))


# --- the comparison ----------------------------------------------------------------------


def prepare(work: Path) -> tuple[list[Path], Path, Path]:
    """Each client's training bytes, the shared held-out file and the starting weights."""
    import importlib

    import numpy as np
    import torch

    work.mkdir(parents=True, exist_ok=True)
    shards, held = [], []
    for c, name in enumerate(PACKAGES):
        pkg = Path(importlib.import_module(name).__file__).parent
        raw = b"".join(f.read_bytes() for f in sorted(pkg.glob("*.py")))
        if len(raw) < TRAIN_BYTES + HELD_BYTES:
            raise SystemExit(f"the sources of {name} hold {len(raw)} bytes; this benchmark needs "
                             f"{TRAIN_BYTES + HELD_BYTES}")
        arr = np.frombuffer(raw, dtype=np.uint8).astype("<u2")
        shards.append(work / f"client-{c}.bin")
        arr[:TRAIN_BYTES].tofile(shards[-1])
        held.append(arr[TRAIN_BYTES:TRAIN_BYTES + HELD_BYTES])
    np.concatenate(held).tofile(work / "heldout.bin")
    torch.manual_seed(INIT_SEED)
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    write_hf(model, work / "init")
    return shards, work / "heldout.bin", work / "init"


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", CHIPSET_BACKEND="cpu")
    e.pop("CHIPSET_SIM_FAULTS", None)
    return e


def check(r: subprocess.CompletedProcess | subprocess.Popen, what: str, log: str = "") -> None:
    if r.returncode:
        raise SystemExit(f"{what} exited {r.returncode}:\n{log[-4000:]}")


def chipset_run(a, shards: list[Path], held: Path, init: Path, out: Path, extra: list[str]) -> dict:
    """``chipset train --nproc 4`` as four one-rank islands with ``extra`` ``--set`` overrides."""
    shutil.rmtree(out, ignore_errors=True)
    steps = a.rounds * a.local_steps
    sets = [f"model.init_from=\"{init}\"", f"train.steps={steps}", f"train.global_batch={BATCH}",
            f"train.seq_len={SHAPE.seq}", f"train.lr={LR}", "train.optimizer=\"sgd\"", "train.momentum=0.0",
            f"train.grad_clip={CLIP}", "train.warmup_steps=0", "train.lr_schedule=\"constant\"",
            "train.dtype=\"float32\"", f"train.checkpoint_every={steps}", "data.source=\"tokens\"",
            f"data.seed={DATA_SEED}", f"islands.count={CLIENTS}", f"islands.sync_every={a.local_steps}",
            "islands.client_data=\"" + ", ".join(map(str, shards)) + "\"", *extra]
    cmd = [sys.executable, "-m", "chipset.cli.main", "train", "--nproc", str(CLIENTS), "--run-dir", str(out),
           "--resume", "none", *[x for s in sets for x in ("--set", s)]]
    t0, c0 = time.perf_counter(), cpu_time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env())
    wall, cpu = time.perf_counter() - t0, cpu_time() - c0
    check(r, "chipset train", r.stdout + r.stderr)
    x = subprocess.run([sys.executable, "-m", "chipset.cli.main", "export", str(out / "island-0"), "--out",
                        str(out / "final"), "--format", "hf"], capture_output=True, text=True, env=env())
    check(x, "chipset export", x.stdout + x.stderr)
    summary = json.loads((out / "summary.json").read_text())
    recs = [json.loads(line) for line in (out / "island-0" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "step_time_s" in r]
    later = [r["step_time_s"] for r in recs if r["step"] > a.local_steps]  # rounds 2 on (see train_s)
    return {"wall_s": wall, "train_s": sum(later), "eval_loss": eval_loss(out / "final", held),
            "bytes_per_round": summary["cross_island_bytes"] / a.rounds, "round1_loss": recs[a.local_steps - 1]["loss"],
            "cpu_s": cpu}


def flower_run(a, shards: list[Path], held: Path, init: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = [sys.executable, __file__, "--peer-path", str(a.peer_path or ""), "--port", str(port)]
    t0, c0 = time.perf_counter(), cpu_time()
    logs = [open(out / f"{n}.log", "w") for n in ("server", *(f"client-{c}" for c in range(CLIENTS)))]
    procs = [subprocess.Popen([*me, "--child", "server", "--rounds", str(a.rounds), "--init", str(init),
                               "--out", str(out / "server.json")], stdout=logs[0], stderr=subprocess.STDOUT, env=env())]
    procs += [subprocess.Popen([*me, "--child", "client", "--client", str(c), "--data", str(shards[c]),
                                "--local-steps", str(a.local_steps), "--out", str(out / f"client-{c}.json")],
                               stdout=logs[c + 1], stderr=subprocess.STDOUT, env=env()) for c in range(CLIENTS)]
    for p in procs:
        p.wait(timeout=1800)
    wall, cpu = time.perf_counter() - t0, cpu_time() - c0
    for f in logs:
        f.close()
    for p, f in zip(procs, logs, strict=True):
        check(p, f"Flower {Path(f.name).stem}", Path(f.name).read_text())
    stats = json.loads((out / "server.json").read_text())
    round1 = json.loads((out / "client-0.json").read_text())["round1_loss"]
    return {"wall_s": wall, "train_s": sum(stats["round_s"][1:]), "eval_loss": eval_loss(out / "final", held),
            "bytes_per_round": statistics.fmean(stats["bytes_per_round"]), "round1_loss": round1, "cpu_s": cpu}


def cpu_time() -> float:
    """User + system seconds of this process's finished children (a job's every process, once waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def loadavg() -> float:
    return os.getloadavg()[0]


def table(got: dict[str, list[dict]], ref: str, name: str) -> str:
    """Medians over the repetitions and their ratios to ``ref``'s (eval loss: the range over them)."""
    med = {k: {key: statistics.median(r[key] for r in runs) for key in ("wall_s", "cpu_s", "train_s")}
           for k, runs in got.items()}
    rows = [f"| run | wall s | CPU s | rounds 2+ s | eval loss | bytes / round | wall / {name} | CPU / {name} | "
            f"rounds 2+ / {name} |", "|---|---|---|---|---|---|---|---|---|"]
    for k, runs in got.items():
        m, f = med[k], med[ref]
        lo, hi = min(r["eval_loss"] for r in runs), max(r["eval_loss"] for r in runs)
        loss = f"{lo:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f}-{hi:.4f}"
        rows.append(f"| {k} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['train_s']:.2f} | {loss} | "
                    f"{runs[0]['bytes_per_round']:,.0f} | {m['wall_s'] / f['wall_s']:.2f} | "
                    f"{m['cpu_s'] / f['cpu_s']:.2f} | {m['train_s'] / f['train_s']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10, help="SGD steps per client per round (islands.sync_every)")
    p.add_argument("--secure", action="store_true", help="also run chipset with secure aggregation")
    p.add_argument("--peer-path", type=Path, default=None, help="a folder flwr was pip-installed into (--target)")
    p.add_argument("--workdir", type=Path, default=Path("runs/federated_vs_flower"))
    p.add_argument("--json", type=Path, default=None)
    for hidden in ("--child", "--port", "--client", "--data", "--init", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.peer_path and str(a.peer_path):
        sys.path.append(str(a.peer_path))
    if a.child == "server":
        flower_server(int(a.port), a.rounds, Path(a.init), Path(a.out))
        return 0
    if a.child == "client":
        flower_client(int(a.port), int(a.client), Path(a.data), a.local_steps, Path(a.out))
        return 0
    import importlib.util

    if importlib.util.find_spec("flwr") is None:
        print("federated_vs_flower: Flower (flwr) is not importable. Install it apart from this environment with "
              "`python -m pip install --target DIR flwr` and pass --peer-path DIR", file=sys.stderr)
        return 2
    import flwr

    work = a.workdir.resolve()
    shards, held, init = prepare(work / "data")
    kinds = ["chipset", *(["chipset+secagg"] if a.secure else []), "flower"]
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(a.reps):
        for k in kinds:
            load = loadavg()
            if k == "flower":
                r = flower_run(a, shards, held, init, work / f"flower-{rep + 1}")
            else:
                r = chipset_run(a, shards, held, init, work / f"{k}-{rep + 1}", FEDAVG + (SECURE if k != "chipset" else []))
            r["load1"] = load
            got[k].append(r)
            print(f"rep {rep + 1} {k:15s} wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  rounds 2+ "
                  f"{r['train_s']:6.2f} s  eval loss {r['eval_loss']:.4f}  bytes/round {r['bytes_per_round']:,.0f}  "
                  f"client 0 loss at step {a.local_steps} {r['round1_loss']:.6f}  load {load:.1f}", flush=True)
    print(f"\n{CLIENTS} clients, {a.rounds} rounds x {a.local_steps} local SGD steps, lr {LR}, "
          f"{BATCH // CLIENTS} x {SHAPE.seq} tokens per client step; Flower {flwr.__version__}, {a.reps} rep(s), "
          f"median load {statistics.median(r['load1'] for v in got.values() for r in v):.1f}")
    print(table(got, "flower", "Flower"))
    if a.json:
        a.json.write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
