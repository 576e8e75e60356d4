"""chipset's islands (DiLoCo) vs torchft's DiLoCo: same model, start, shards, inner and outer steps.

    python benchmarks/diloco_vs_torchft.py [--reps 3] [--rounds 10] [--local-steps 10]
        [--peer-path DIR] [--workdir runs/diloco_vs_torchft] [--json OUT]

Needs torchft. Its wheels carry the Rust lighthouse prebuilt (``torchft-nightly`` or ``torchft``
for Linux x86_64); install it apart from this environment, without letting pip replace torch:
``python -m pip install --target DIR --no-deps torchft-nightly`` and pass ``--peer-path DIR``.

The task, model, start weights, client shards and inner steps are benchmarks/federated_vs_flower.py's
(four replicas, each with its own text, plain SGD at lr 0.3, gradient norm clipped to 1.0); every
``--local-steps`` inner steps the replicas average their pseudo-gradients (the global parameters
minus their own) and take DiLoCo's outer step, Nesterov SGD at lr 0.7 with momentum 0.9 (the paper's).

- chipset: ``chipset train --nproc 4`` with ``islands.count = 4``, ``islands.outer_optimizer =
  "nesterov"``, ``outer_lr = 0.7``, ``outer_momentum = 0.9``: four processes on the ``cpu`` backend;
- torchft: a ``LighthouseServer`` process and four replica-group processes of one rank each, each
  with its own ``TCPStore``, a ``Manager`` over ``ProcessGroupGloo`` (synchronous quorum, every
  replica required) and ``torchft.local_sgd.DiLoCo`` around ``torch.optim.SGD`` inner and
  ``torch.optim.SGD(nesterov=True)`` outer optimizers; plain torch otherwise
  (benchmarks/plain_torch_lm.py's model, which never imports chipset).

Printed as in federated_vs_flower.py: wall time of the whole job, training time from round 2 on
(chipset: island 0's summed ``step_time_s`` of those steps; torchft: replica 0 from the end of its
first outer step to the end of its last; round 1 holds each side's start-up and first quorum), the
held-out eval loss of the final global model (the same plain-torch evaluation for both), the bytes
the replicas hand to the outer all-reduce per round (chipset: ``cross_island_bytes``; torchft
reports none, so the script counts the float32 pseudo-gradients it averages: 4 bytes per parameter
per replica), the CPU seconds of all the job's processes and replica 0's loss on the last inner
step of round 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from federated_vs_flower import (  # noqa: E402  (the shared task, model and chipset side)
    CLIENTS,
    CLIP,
    LR,
    SHAPE,
    build_model,
    check,
    chipset_run,
    client_batch,
    cpu_time,
    env,
    eval_loss,
    loadavg,
    prepare,
    read_hf,
    table,
    tokens,
    write_hf,
)

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
DILOCO = ["islands.outer_optimizer=\"nesterov\"", f"islands.outer_lr={OUTER_LR}",
          f"islands.outer_momentum={OUTER_MOMENTUM}"]


# --- the peer's side: plain torch and torchft, no chipset ---------------------------------


def lighthouse(out: Path) -> None:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=CLIENTS)
    out.write_text(server.address())
    while True:  # until the parent ends it
        time.sleep(1)


def replica(address: str, client: int, data_path: Path, init: Path, steps: int, local_steps: int, out: Path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    model, data = read_hf(build_model(), init), tokens(data_path)
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    wait = timedelta(seconds=600)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait), min_replica_size=CLIENTS, use_async_quorum=False, init_sync=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica-{client}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=address, timeout=wait, quorum_timeout=wait, connect_timeout=wait)
    losses = []
    with DiLoCo(manager, [model], inner, outer, sync_every=local_steps):
        for step in range(steps):
            x, y = client_batch(data, step, client)
            loss = F.cross_entropy(model(x).reshape(-1, SHAPE.vocab), y.reshape(-1))
            inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            inner.step()  # DiLoCo's hook takes the outer step after every local_steps of these
            losses.append(float(loss.detach()))
            if step == local_steps - 1:  # after the first outer step: rounds 2 on, as for chipset
                t1 = time.perf_counter()
    train_s = time.perf_counter() - t1
    if client == 0:
        write_hf(model, out.parent / "final")
    out.write_text(json.dumps({"round1_loss": losses[local_steps - 1], "train_s": train_s, "outer_steps": manager.current_step(),
                               "pseudo_grad_bytes": sum(p.numel() * 4 for p in model.parameters())}))
    manager.shutdown(wait=False)


# --- the comparison ----------------------------------------------------------------------


def torchft_run(a, shards: list[Path], held: Path, init: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    me = [sys.executable, __file__, "--peer-path", str(a.peer_path or "")]
    t0, c0 = time.perf_counter(), cpu_time()
    lh_log = open(out / "lighthouse.log", "w")
    lh = subprocess.Popen([*me, "--child", "lighthouse", "--out", str(out / "lighthouse.addr")], stdout=lh_log,
                          stderr=subprocess.STDOUT, env=env())
    try:
        while not (out / "lighthouse.addr").exists() or not (out / "lighthouse.addr").read_text():
            if lh.poll() is not None:
                check(lh, "torchft lighthouse", (out / "lighthouse.log").read_text())
            time.sleep(0.2)
        address = (out / "lighthouse.addr").read_text()
        logs = [open(out / f"replica-{c}.log", "w") for c in range(CLIENTS)]
        procs = [subprocess.Popen([*me, "--child", "replica", "--address", address, "--client", str(c), "--data",
                                   str(shards[c]), "--init", str(init), "--rounds", str(a.rounds), "--local-steps",
                                   str(a.local_steps), "--out", str(out / f"replica-{c}.json")],
                                  stdout=logs[c], stderr=subprocess.STDOUT, env=env()) for c in range(CLIENTS)]
        for p in procs:
            p.wait(timeout=1800)
        wall = time.perf_counter() - t0
    finally:
        lh.terminate()
        lh.wait()
        lh_log.close()
    cpu = cpu_time() - c0
    for c, (p, f) in enumerate(zip(procs, logs, strict=True)):
        f.close()
        check(p, f"torchft replica {c}", Path(f.name).read_text())
    r0 = json.loads((out / "replica-0.json").read_text())
    if r0["outer_steps"] != a.rounds:
        raise SystemExit(f"torchft took {r0['outer_steps']} outer steps; expected {a.rounds}")
    return {"wall_s": wall, "train_s": r0["train_s"], "eval_loss": eval_loss(out / "final", held),
            "bytes_per_round": r0["pseudo_grad_bytes"] * CLIENTS, "round1_loss": r0["round1_loss"], "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="outer steps")
    p.add_argument("--local-steps", type=int, default=10, help="inner steps per outer step (islands.sync_every)")
    p.add_argument("--peer-path", type=Path, default=None, help="a folder torchft was pip-installed into (--target)")
    p.add_argument("--workdir", type=Path, default=Path("runs/diloco_vs_torchft"))
    p.add_argument("--json", type=Path, default=None)
    for hidden in ("--child", "--address", "--client", "--data", "--init", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.peer_path and str(a.peer_path):
        sys.path.append(str(a.peer_path))
    if a.child == "lighthouse":
        lighthouse(Path(a.out))
        return 0
    if a.child == "replica":
        replica(a.address, int(a.client), Path(a.data), Path(a.init), a.rounds * a.local_steps, a.local_steps,
                Path(a.out))
        return 0
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        print("diloco_vs_torchft: torchft is not importable. Install it apart from this environment with "
              "`python -m pip install --target DIR --no-deps torchft-nightly` and pass --peer-path DIR",
              file=sys.stderr)
        return 2
    work = a.workdir.resolve()
    shards, held, init = prepare(work / "data")
    got: dict[str, list[dict]] = {"chipset": [], "torchft": []}
    for rep in range(a.reps):
        for k in got:
            load = loadavg()
            if k == "torchft":
                r = torchft_run(a, shards, held, init, work / f"torchft-{rep + 1}")
            else:
                r = chipset_run(a, shards, held, init, work / f"chipset-{rep + 1}", DILOCO)
            r["load1"] = load
            got[k].append(r)
            print(f"rep {rep + 1} {k:8s} wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  rounds 2+ "
                  f"{r['train_s']:6.2f} s  eval loss {r['eval_loss']:.4f}  bytes/round {r['bytes_per_round']:,.0f}  "
                  f"replica 0 loss at step {a.local_steps} {r['round1_loss']:.6f}  load {load:.1f}", flush=True)
    print(f"\n{CLIENTS} replicas, {a.rounds} outer steps (Nesterov lr {OUTER_LR}, momentum {OUTER_MOMENTUM}) x "
          f"{a.local_steps} inner SGD steps at lr {LR}; {a.reps} rep(s), median load "
          f"{statistics.median(r['load1'] for v in got.values() for r in v):.1f}")
    print(table(got, "torchft", "torchft"))
    if a.json:
        a.json.write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
